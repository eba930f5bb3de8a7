"""Prompt data files (JSONL or Parquet): reading, and checking every row before a run starts.

`read_rows(path, prompt_key)` returns the rows, or raises `DataError` with one line that
names the file and, for JSONL, the line: a file that is missing or empty, a line that is
not JSON, a row that is not an object, a row without `prompt_key`, or a prompt that is
neither text nor a list of chat messages (`{"role": ..., "content": ...}`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtime.errors import TandemError


class DataError(TandemError, ValueError):
    """A data file that cannot be trained on; the message names the file (and line)."""


def read_rows(path: str, prompt_key: str, key: str = "data.path") -> list[dict[str, Any]]:
    """`key`: the config key that named the file (in the error messages)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{key} '{path}' does not exist")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(p).to_pylist()
        where = [f"{path} row {i}" for i in range(len(rows))]
    else:
        rows, where = [], []
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
            where.append(f"{path}:{n}")
    if not rows:
        raise DataError(f"{key} '{path}' has no rows")
    for row, at in zip(rows, where, strict=True):
        check_row(row, prompt_key, at)
    return rows


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
