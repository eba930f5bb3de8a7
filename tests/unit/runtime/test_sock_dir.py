"""A run's ipc socket directory (runtime/identity/addresses.py) is this user's, mode 0700: made so,
a pre-existing one with a wider mode is narrowed, and a symlink is refused."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from runtime.identity import addresses


def test_socket_directory_is_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    made = addresses.sock_dir(tmp_path / "run-a")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700 and made.stat().st_uid == os.geteuid()
    made.chmod(0o777)
    assert stat.S_IMODE(addresses.sock_dir(tmp_path / "run-a").stat().st_mode) == 0o700
    other = addresses.sock_dir(tmp_path / "run-b")
    other.rmdir()
    other.symlink_to(tmp_path)
    with pytest.raises(RuntimeError, match="not a directory of this user"):
        addresses.sock_dir(tmp_path / "run-b")
