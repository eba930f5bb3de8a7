"""Bad inputs fail before anything starts: each used to cost 12–28 s
of spawning roles and end in a traceback fragment. Now `tandem launch` checks them first:
exit 2, one line naming the key and the file, no role spawned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

LAUNCH = [sys.executable, "-m", "runtime.cli", "launch", "configs/tiny_cpu.yaml"]
# LAUNCH as a child of a fresh interpreter that passes on its exit status and stderr and
# prints the child's peak resident memory (KiB) last on stdout
MEASURED = [
    sys.executable,
    "-c",
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)",
    *LAUNCH,
]


def model_dir(tmp_path: Path, *, truncate: bool = False) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    blob = len(header).to_bytes(8, "little") + header + bytes(16)
    (d / "model.safetensors").write_bytes(blob[:-8] if truncate else blob)
    return d


def data_file(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def data_bytes(tmp_path: Path, blob: bytes, name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(blob)
    return path


def hundred_mb_row(tmp_path: Path) -> Path:
    """One 100 MB line (written in pieces: the test holds no 100 MB string either)."""
    path = tmp_path / "data.jsonl"
    with path.open("wb") as f:
        f.write(b'{"prompt": "ok"}\n{"prompt": "')
        for _ in range(100):
            f.write(b"a" * 2**20)
        f.write(b'"}\n')
    return path


def file_source(path: Path) -> list[str]:
    return ["data.source=file", f"data.path={path}"]


def rows_with_a_list(tmp_path: Path) -> Path:
    return data_file(tmp_path, [json.dumps({"prompt": "a"}), json.dumps([1, 2])])


CASES = {
    "missing model": (lambda t: [f"model.path={t / 'nope'}"], "model.path '", "is not a directory"),
    "corrupt model": (lambda t: [f"model.path={model_dir(t, truncate=True)}"], "model.safetensors is truncated", ""),
    "missing data": (lambda t: ["data.source=file", f"data.path={t / 'none.jsonl'}"], "does not exist", ""),
    "missing data, relative path": (
        lambda t: ["data.source=file", "data.path=arith.jsonl"],
        f"data.path 'arith.jsonl' does not exist (a relative path is read from the current directory, {ROOT})",
        "",
    ),
    "empty data": (lambda t: ["data.source=file", f"data.path={data_file(t, [])}"], "has no rows", ""),
    "row not an object": (
        lambda t: ["data.source=file", f"data.path={rows_with_a_list(t)}"],
        "data.jsonl:2: a row",
        "",
    ),
    "a 100 MB row": (
        lambda t: file_source(hundred_mb_row(t)),
        "data.jsonl:2: a row of more than 1048576 bytes (data.max_row_bytes)",
        "",
    ),
    "a lone surrogate": (
        lambda t: file_source(data_file(t, ['{"prompt": "ab\\ud800cd"}'])),
        "data.jsonl:1: field 'prompt' holds text that is not valid Unicode (\\ud800 at character 2)",
        "",
    ),
    "non-UTF-8 bytes": (
        lambda t: file_source(data_bytes(t, b'{"prompt": "abc\xff"}\n')),
        "data.jsonl:1: not UTF-8 text (byte 0xff at column 16)",
        "",
    ),
    "a binary file": (lambda t: file_source(data_bytes(t, bytes(range(256)) * 64)), "data.jsonl:1: ", ""),
    "a corrupt parquet file": (
        lambda t: file_source(data_bytes(t, b"PAR1 this is not parquet PAR1", "data.parquet")),
        "data.parquet' is not a readable Parquet file",
        "",
    ),
    "missing reward module": (
        lambda t: ["reward.functions=[no_such_pkg.rewards:score]"],
        "cannot import 'no_such_pkg",
        "",
    ),
    "max_tokens over the context": (lambda t: ["rollout.max_tokens=512"], "rollout.max_tokens (512) must be below", ""),
    "reward module raises at import": (
        lambda t: ["reward.functions=[tests.helpers.raises_at_import:score]"],
        "importing 'tests.helpers.raises_at_import' failed: RuntimeError: reward table missing",
        "",
    ),
    "data.path without data.source=file": (
        lambda t: [f"data.path={data_file(t, ['{}'])}"],
        "data.path is set but data.source is synthetic",
        "",
    ),
    "reward.functions without a reward role": (
        lambda t: [
            "reward.functions=[tests.helpers.rewards:slow_zero]",
            "placement=[{role: controller}, {role: rollout}, {role: trainer, count: 2}]",
        ],
        "placement has no reward role",
        "",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_input_fails_at_once_in_one_line(tmp_path: Path, case: str) -> None:
    overrides, *expected = CASES[case]
    run = tmp_path / "run"
    started = time.monotonic()
    out = subprocess.run([*MEASURED, f"run_dir={run}", *overrides(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    took = time.monotonic() - started
    peak_mb = int(out.stdout.strip().rsplit("\n", 1)[-1]) / 1024  # the launcher's peak RSS (MEASURED prints it)
    assert out.returncode == 2, out.stdout + out.stderr
    line = out.stderr.strip()
    assert "\n" not in line and line.startswith("tandem: error: ") and all(e in line for e in expected), line
    assert not (run / "logs").exists(), "a role was started"
    # 2 s on an idle machine (python's start and the config's imports); a margin for CI's.
    assert took < 6.0, took
    assert peak_mb < 400, peak_mb  # ~150 MB on an idle machine; a 100 MB row read whole would pass 400


def test_ipc_weight_sync_without_a_gpu_is_refused_within_two_seconds(tmp_path: Path) -> None:
    """The issue's case: accepted, the run hung at step 2."""
    run = tmp_path / "run"
    started = time.monotonic()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a machine with one
    out = subprocess.run(
        [*LAUNCH, f"run_dir={run}", "weight_sync.backend=ipc"], cwd=ROOT, capture_output=True, text=True, env=env
    )
    took = time.monotonic() - started
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip() == (
        "tandem: error: weight_sync.backend=ipc needs a GPU (CUDA IPC) and this machine has none: "
        "use weight_sync.backend=zmq or auto"
    )
    assert not (run / "logs").exists()
    assert took < 2.0, took


def test_wandb_without_a_login_is_refused_before_any_role_starts(tmp_path: Path) -> None:
    """The issue's case: vLLM started, and ~24 s later the run died with a cut traceback and
    wandb's `UsageError: No API key configured`."""
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    env |= {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / ".config")}  # no netrc, no wandb settings
    started = time.monotonic()
    out = subprocess.run(
        [*LAUNCH, f"run_dir={run}", "metrics.wandb=true"], cwd=ROOT, capture_output=True, text=True, env=env
    )
    took = time.monotonic() - started
    assert out.returncode == 2, out.stdout + out.stderr
    line = out.stderr.strip()
    assert "\n" not in line and line.startswith("tandem: error: metrics.wandb=true but wandb has no API key"), line
    assert not (run / "logs").exists(), "a role was started"
    assert took < 5.0, took  # the bound: about 2.5 s on an idle machine
