"""`rollout.seeded_sampling`: a synchronous tiny run repeats bit for bit on CPU, however
vLLM batches its requests. The two runs below batch differently on purpose (the second
lets at most two groups into vLLM at once, the first all eight of a step), so without a
seed per sample they draw different tokens from step 2 on (vLLM's shared generator is
consumed in batch order)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_tiny_run import run_tiny

pytestmark = pytest.mark.slow
SEEDED = ["rollout.seeded_sampling=true", "rollout.max_staleness=0", "trainer.total_steps=4"]
SAME = ("loss", "grad_norm", "reward_mean", "response_len_mean", "entropy", "kl_behaviour_proximal")


def test_seeded_sync_runs_repeat_bit_for_bit_whatever_vllm_batches(tmp_path: Path) -> None:
    wide, _ = run_tiny(tmp_path / "wide", *SEEDED)
    narrow, _ = run_tiny(tmp_path / "narrow", *SEEDED, "rollout.engine.max_num_seqs=16")
    assert [m["step"] for m in wide] == [m["step"] for m in narrow] == [1, 2, 3, 4]
    for a, b in zip(wide, narrow, strict=True):
        assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}, f"step {a['step']}"
