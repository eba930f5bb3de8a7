"""A storage error ends the run at once naming the file and the error: a full
disk under metrics.jsonl, and the one line of a failed checkpoint save, which names the
folder, ENOSPC (also where torch's writer hid the errno: the file system is full) and
the last intact checkpoint, and removes the save's partial files."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from roles.controller.metrics import REQUIRED_KEYS, MetricsSink
from runtime.checkpoints import checkpoint
from runtime.config import MetricsConfig
from runtime.role import FatalError
from tests.unit.runtime.test_run_dir import fake_checkpoint


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_metrics_line_on_a_full_disk_ends_the_run_naming_the_file(tmp_path: Path) -> None:
    sink = MetricsSink(tmp_path / "metrics.jsonl", MetricsConfig(), tmp_path, "t")
    sink._file = open("/dev/full", "w", buffering=1)  # noqa: SIM115 (every write: ENOSPC)
    sink.path = Path("/dev/full")
    with pytest.raises(FatalError, match=r"cannot write /dev/full: No space left on device \(ENOSPC\)"):
        sink.write({k: 0.0 for k in REQUIRED_KEYS} | {"step": 1})


def test_a_failed_save_names_enospc_the_folder_and_the_last_intact_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    previous = fake_checkpoint(tmp_path, 2, ["controller.json"])
    partial = checkpoint.begin(tmp_path, 4)
    (partial / "actor").mkdir()
    (partial / "actor" / "shard").write_bytes(b"x" * 100)
    usage: Any = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=12 << 10))  # a full file system
    line = checkpoint.save_failure(tmp_path, 4, "trainer-0: CheckpointException (rank 1: RuntimeError: unexpected pos)")
    root = tmp_path / "checkpoints"
    assert line == (
        f"checkpoint of step 4 into {root} failed: No space left on device (ENOSPC): the file system of {root} has "
        f"12 KiB free; trainer-0: CheckpointException (rank 1: RuntimeError: unexpected pos); the last intact "
        f"checkpoint is {previous} (resume=auto continues from it)"
    )
    assert not partial.exists() and previous.is_dir()


def test_an_error_that_names_enospc_is_named_so_without_measuring(tmp_path: Path) -> None:
    line = checkpoint.save_failure(tmp_path, 4, "OSError: [Errno 28] No space left on device: '/x/controller.json'")
    assert line.endswith("there is no intact checkpoint"), line
    assert "failed: No space left on device (ENOSPC); OSError: [Errno 28]" in line, line  # named, no free-space guess
