"""Benchmark scripts run end to end in their `--quick` mode and print the JSON they promise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(90)
def test_transport_benchmark_quick() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "transport.py"), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)  # exactly one JSON object on stdout
    assert result["benchmark"] == "transport" and result["quick"] is True
    for transport in ("ipc", "tcp"):
        for size in ("1MiB", "16MiB", "64MiB"):
            row = result["throughput_mib_s"][transport][size]
            assert row["zero_copy_mib_s"] > 0 and row["pickle_mib_s"] > 0
            assert row["zero_copy_over_pickle"] > 0
        latency = result["latency_us"][transport]
        for path in ("rpc", "pickle_raw_zmq", "pickle_sync_zmq"):
            assert 0 < latency[path]["p50_us"] <= latency[path]["p90_us"] <= latency[path]["p99_us"]
        assert latency["p50_rpc_over_pickle"] > 0
    assert set(result["targets"]) == {"ipc_64MiB_zero_copy_over_pickle_ge_3", "ipc_rtt_p50_under_200us"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_benchmark_quick(tmp_path: Path) -> None:
    """The engine and the bare padded loop train the same batches: their first losses agree."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "trainer.json"
    script = str(ROOT / "benchmarks" / "trainer.py")
    cases = ["--cases", "fixed_4k", "length_mix"]  # fixed_1k is the same code as fixed_4k
    done = subprocess.run(
        [sys.executable, script, "--quick", *cases, "--profile", "3", "--trace", str(tmp_path / "traces"),
         "--model-dir", str(tmp_path), "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result == json.loads(out.read_text())
    assert result["loss_match"] is True and result["mfu_4k"] > 0 and result["speedup_length_mix"] > 0
    assert result["benchmark"] == "trainer" and result["measured_at"].endswith("Z") and result["commit"]
    for case in ("fixed_4k", "length_mix"):
        for loop in ("engine", "bare"):
            assert result["cases"][case][loop]["tokens_per_s"] > 0
        profile = result["cases"][case]["engine"]["profile"]
        assert sum(profile["share"].values()) == pytest.approx(1.0, abs=1e-3) and len(profile["top"]) == 3
        assert len(profile["ops"]) == 3 and all(op["ms"] > 0 for op in profile["ops"])
        assert (tmp_path / "traces" / f"{case}.json.gz").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_benchmark_variants(tmp_path: Path) -> None:
    """`--variant` runs the engine again with its options, then the base once more: a variant
        with the same sums (reduced accumulation) has the base's losses after the same updates,
        one that changes them (another learning rate) does not, one that cannot start (FSDP offload on the
    CPU) is recorded as an error while the rest run."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "trainer.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "trainer.py"), "--quick", "--cases", "length_mix", "--loops",
         "engine", "--steps", "2", "--variant", "reduced", "fsdp.one_rank_accumulation=reduced", "--variant",
         "lr", "trainer.optim.lr=1e-3", "--variant", "bad", "fsdp.cpu_offload=true", "--model-dir",
         str(tmp_path), "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    base = result["cases"]["length_mix"]["engine"]
    variants = result["variants"]
    assert list(variants) == ["reduced", "lr", "bad", "base_again"]
    assert "fsdp.cpu_offload" in variants["bad"]["error"] and not variants["bad"]["cases"]
    assert variants["reduced"]["options"] == ["fsdp.one_rank_accumulation=reduced"]
    again, reduced, lr = (variants[name]["cases"]["length_mix"] for name in ("base_again", "reduced", "lr"))
    assert again["last_loss"] == base["last_loss"] and again["drift"] > 0
    assert reduced["last_loss"] == base["last_loss"] and reduced["last_loss_diff"] == 0.0
    assert reduced["first_loss"] == lr["first_loss"] == base["first_loss"]
    assert lr["last_loss_diff"] > 0 and reduced["speedup"] > 0 and lr["speedup"] > 0
    refused = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "trainer.py"), "--quick", "--loops", "bare", "--variant", "x",
         "trainer.compile=true", "--out", str(tmp_path / "no.json")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2 and "--variant compares engine runs" in refused.stderr
