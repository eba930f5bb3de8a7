"""runtime/data/data_files.py's one-line refusals that say what to do: a relative path that is
not there names the directory it was read from, a directory is told as one, and a Parquet
file without pyarrow names the extra that installs it (it was an import traceback)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from runtime.data.data_files import DataError, read_rows


def test_a_missing_relative_path_names_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as caught:
        read_rows("arith.jsonl", "prompt")
    assert str(caught.value) == (
        f"data.path 'arith.jsonl' does not exist (a relative path is read from the current directory, {tmp_path})"
    )
    with pytest.raises(DataError, match=r"^data.path '/nowhere/a.jsonl' does not exist$"):
        read_rows("/nowhere/a.jsonl", "prompt")
    with pytest.raises(DataError, match="is a directory, not a JSONL or Parquet file"):
        read_rows(str(tmp_path), "prompt")


def test_parquet_without_pyarrow_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "rows.parquet"
    path.write_bytes(b"PAR1")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else real(name, *a))
    with pytest.raises(DataError, match=r"needs the parquet extra .*pip install -e '\.\[parquet\]'$"):
        read_rows(str(path), "prompt")
