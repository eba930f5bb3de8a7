"""The run's inputs, checked before any process starts (in well under 2 s, without torch):
the model directory and the prompt data. Each failure is a `ConfigError` of one line
naming the key and the file.

* `model.path` (when set): a directory with a `config.json` that is a JSON object, and
  weights (`*.safetensors` or `*.bin`); every safetensors file's header must parse and its
  tensors must lie within the file (a truncated or corrupt download fails here).
* `data.path` (with `data.source=file`) and `validation.data` (a file): every row, as
  runtime/data/data_files.py checks it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from runtime.config import RunConfig
from runtime.data.data_files import DataError, read_rows
from runtime.errors import ConfigError


def check_inputs(cfg: RunConfig) -> None:
    if cfg.model.path:
        check_model_dir(Path(cfg.model.path))
    if cfg.data.source == "file":
        _check_rows(cfg.data.path, cfg.data.prompt_key, "data.path", cfg.data.max_row_bytes)
    if cfg.validation.every and cfg.validation.data != "synthetic":
        _check_rows(cfg.validation.data, cfg.data.prompt_key, "validation.data", cfg.data.max_row_bytes)


def _check_rows(path: str, prompt_key: str, key: str, max_row_bytes: int) -> None:
    try:
        read_rows(path, prompt_key, key, max_row_bytes)
    except DataError as exc:
        raise ConfigError(str(exc)) from None


def check_model_dir(path: Path) -> None:
    where = f"model.path '{path}'"
    if not path.is_dir():
        raise ConfigError(f"{where} is not a directory")
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where} has no config.json") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: config.json is not valid JSON ({exc.msg})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: config.json is not a JSON object")
    weights = sorted(path.glob("*.safetensors"))
    if not weights and not list(path.glob("*.bin")):
        raise ConfigError(f"{where} has no weights (*.safetensors or *.bin)")
    for file in weights:
        _check_safetensors(file, where)


def _check_safetensors(file: Path, where: str) -> None:
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"{where}: {file.name} is truncated ({size} bytes)")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, 100 << 20):
            raise ConfigError(f"{where}: {file.name} is not a safetensors file (header of {length} bytes)")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConfigError(f"{where}: {file.name} has a corrupt header") from None
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end > size:
        raise ConfigError(f"{where}: {file.name} is truncated ({size} bytes, its tensors need {8 + length + end})")
