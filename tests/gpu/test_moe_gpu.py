"""A mixture of experts on one GPU with routing replay: the tiny Qwen3-MoE recipe with the
rollout and a 1-rank FSDP2 trainer colocated on GPU 0, vLLM reporting the experts it routed
every token to, the expert weights going to vLLM over CUDA IPC (`weight_sync.backend=auto`).

* With `algorithm.routing_replay: rollout` every reported token trains on vLLM's experts:
  `routing_mismatch` is 0 on every step, while `router_disagree` says how often the trainer
  would have routed otherwise; the expert weights reach vLLM (the behaviour/proximal gap
  stays at engine noise).
* With `measure` the trainer routes itself and the same disagreement shows as mismatch.

Needs vLLM's MoE kernels (a full vLLM wheel): `python -m pytest -m gpu tests/gpu/test_moe_gpu.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.test_gpu_run import GPU_ENGINE, launch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
ON_GPU0 = (
    "placement=[{role: controller}, {role: reward}, {role: rollout, devices: [0]},"
    " {role: trainer, count: 1, devices: [0]}]",
    "trainer.device=cuda",
    "trainer.total_steps=8",
    "model.tiny.num_experts=8",
    "model.tiny.initializer_range=0.2",  # routers far from uniform: routing is decided, not a tie
)


def steps(metrics: list[dict]) -> list[dict]:
    return [m for m in metrics if "kind" not in m]


def test_replayed_moe_run_trains_on_the_rollouts_experts(tmp_path: Path) -> None:
    metrics = steps(launch(tmp_path / "replay", *GPU_ENGINE, *ON_GPU0, "algorithm.routing_replay=rollout"))
    assert len(metrics) == 8
    for m in metrics:
        assert m["routed_tokens"] > 0, m
        assert m["routing_mismatch"] == 0.0, m
        assert 0.0 <= m["router_disagree"] <= 1.0, m
        assert m["kl_behaviour_proximal"] < 0.05, m


def test_measured_moe_run_reports_the_disagreement_as_mismatch(tmp_path: Path) -> None:
    metrics = steps(launch(tmp_path / "measure", *GPU_ENGINE, *ON_GPU0, "algorithm.routing_replay=measure"))
    assert len(metrics) == 8
    for m in metrics:
        assert m["routed_tokens"] > 0, m
        assert m["routing_mismatch"] == pytest.approx(m["router_disagree"]), m
