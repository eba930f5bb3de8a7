"""Prompt data files (JSONL or Parquet): reading, and checking every row before a run starts.

`read_rows(path, prompt_key)` returns the rows, or raises `DataError` with one line that
names the file and, for JSONL, the line: a file that is missing, empty or unreadable (a
Parquet file pyarrow cannot read), a line that is not UTF-8 or not JSON, a line longer
than `max_row_bytes` (`data.max_row_bytes`; found without reading more of it than that),
a row that is not an object, a row without `prompt_key`, a prompt that is neither text
nor a list of chat messages (`{"role": ..., "content": ...}`), or text anywhere in a row
that cannot be encoded (a lone UTF-16 surrogate such as `"\\ud800"` is valid JSON, but no
tokenizer takes it). A relative path that is missing is named with the current directory it
was looked for in; a Parquet file without pyarrow installed names the extra that installs it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from runtime.errors import TandemError, one_line

MAX_ROW_BYTES = 2**20  # data.max_row_bytes's default


class DataError(TandemError, ValueError):
    """A data file that cannot be trained on; the message names the file (and line)."""


def read_rows(
    path: str, prompt_key: str, key: str = "data.path", max_row_bytes: int = MAX_ROW_BYTES
) -> list[dict[str, Any]]:
    """`key`: the config key that named the file (in the error messages)."""
    p = Path(path)
    if p.is_dir():
        raise DataError(f"{key} '{path}' is a directory, not a JSONL or Parquet file")
    if not p.is_file():
        hint = "" if p.is_absolute() else f" (a relative path is read from the current directory, {Path.cwd()})"
        raise DataError(f"{key} '{path}' does not exist{hint}")
    try:
        rows, where = _parquet_rows(p, key) if p.suffix == ".parquet" else _jsonl_rows(p, max_row_bytes)
    except OSError as exc:
        raise DataError(f"{key} '{path}' cannot be read: {one_line(exc, 200)}") from None
    if not rows:
        raise DataError(f"{key} '{path}' has no rows")
    for row, at in zip(rows, where, strict=True):
        check_row(row, prompt_key, at)
        _check_text(row, at, max_row_bytes)
    return rows


def _parquet_rows(p: Path, key: str) -> tuple[list[Any], list[str]]:
    if importlib.util.find_spec("pyarrow") is None:
        raise DataError(
            f"{key} '{p}' is a Parquet file, which needs the parquet extra (the pyarrow package is not "
            "installed): .venv/bin/python -m pip install -e '.[parquet]'"
        )
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(p).to_pylist()
    except Exception as exc:  # pyarrow raises several types for a file that is not Parquet
        raise DataError(f"{key} '{p}' is not a readable Parquet file: {one_line(exc, 200)}") from None
    return rows, [f"{p} row {i}" for i in range(len(rows))]


def _jsonl_rows(p: Path, max_row_bytes: int) -> tuple[list[Any], list[str]]:
    rows, where = [], []
    with p.open("rb") as f:
        for n in range(1, 2**62):
            raw = f.readline(max_row_bytes + 1)
            if not raw:
                break
            if len(raw) > max_row_bytes and not (len(raw) == max_row_bytes + 1 and raw.endswith(b"\n")):
                raise DataError(f"{p}:{n}: a row of more than {max_row_bytes} bytes (data.max_row_bytes)")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad = f"byte 0x{raw[exc.start]:02x} at column {exc.start + 1}"
                raise DataError(f"{p}:{n}: not UTF-8 text ({bad})") from None
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(f"{p}:{n}: not valid JSON ({exc.msg})") from None
            where.append(f"{p}:{n}")
    return rows, where


def _check_text(value: Any, at: str, max_bytes: int, field: str = "") -> None:
    """Every string in a row encodes as UTF-8 (no lone surrogates); a Parquet row's text
    is bounded as a JSONL line is."""
    if isinstance(value, str):
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError as exc:
            bad = value[exc.start].encode("unicode_escape").decode()
            raise DataError(
                f"{at}: field '{field}' holds text that is not valid Unicode ({bad} at character {exc.start})"
            ) from None
        if size > max_bytes:
            raise DataError(f"{at}: field '{field}' holds {size} bytes, more than data.max_row_bytes={max_bytes}")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(v, at, max_bytes, f"{field}.{k}" if field else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text(v, at, max_bytes, f"{field}[{i}]")


def check_row(row: Any, prompt_key: str, at: str) -> None:
    if not isinstance(row, dict):
        raise DataError(f"{at}: a row must be a JSON object, not {type(row).__name__}")
    if prompt_key not in row:
        raise DataError(f"{at}: no field '{prompt_key}' (data.prompt_key)")
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{at}: field '{prompt_key}' is empty")
        return
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "content" in m for m in prompt):
        return
    raise DataError(f"{at}: field '{prompt_key}' must be text or a list of chat messages, not {type(prompt).__name__}")
