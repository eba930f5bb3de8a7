"""The plan's trainer step time (runtime/memory/step_time.py): each part from its named
assumption, the line the plan prints, and none of it where no trainer is on a GPU."""

from __future__ import annotations

import pytest

from runtime.memory import step_time as st
from runtime.memory.auto import load_settled
from runtime.memory.estimate import model_shape
from runtime.memory.plan import build_plan, format_plan

HOST = "memory.host_gb=128"


def _load(recipe: str, gpu_gb: float, *overrides: str):
    return load_settled(f"configs/{recipe}.yaml", [f"memory.gpu_gb={gpu_gb}", HOST, *overrides])


def test_tokens_of_a_step_are_prompt_and_response_of_every_sample() -> None:
    cfg = _load("bench_1.5b", 80)
    assert st.step_tokens(cfg) == 16 * 8 * (cfg.data.synthetic_prompt_len + 512)


def test_compute_is_6n_tokens_at_the_assumed_mfu() -> None:
    cfg = _load("bench_1.5b", 80)
    shape = model_shape(cfg)
    time = st.step_time(cfg, shape, 1)
    flops = 6 * shape.num_params * st.step_tokens(cfg)
    assert time.parts == {"compute": pytest.approx(flops / (st.ASSUMED_MFU * st.PEAK_TFLOPS * 1e12))}
    assert st.step_time(cfg, shape, 2).parts["compute"] == pytest.approx(time.parts["compute"] / 2)


def test_full_offload_counts_its_copies_and_the_cpu_optimizer() -> None:
    cfg = _load("bench_7b", 80)  # auto: fsdp.cpu_offload, 32768-token micro-batches
    shape = model_shape(cfg)
    parts = st.step_time(cfg, shape, 1).parts
    n, micro = shape.num_params, 3  # 67,584 tokens in micro-batches of 32,768
    copies = (4 * n + micro * 4 * n) / 1e9 / st.PAGEABLE_GBPS  # shards in once, every micro-batch's gradients out
    host = ((micro - 1) * st.CPU_ADD_BYTES + st.CPU_CLIP_BYTES + st.CPU_ADAMW_BYTES) * n / 1e9 / st.HOST_GBPS
    assert parts["host<->GPU copies"] == pytest.approx(copies)
    assert parts["CPU optimizer"] == pytest.approx(host)
    assert 30 < sum(parts.values()) < 45  # about 36 s: the plan says so before the run starts


def test_optimizer_offload_streams_the_moments_at_the_pinned_bandwidth() -> None:
    cfg = _load("bench_7b", 141)  # auto: trainer.offload.optimizer
    shape = model_shape(cfg)
    part = st.step_time(cfg, shape, 1).parts["optimizer offload"]
    assert part == pytest.approx(8 * shape.num_params / 1e9 / st.PINNED_GBPS)
    assert 1.2 < part < 1.5  # measured on one H200: 1.33 s (BENCHMARKS.md)


def test_the_plan_prints_the_estimate_with_its_assumptions() -> None:
    cfg = _load("bench_7b", 80)
    plan = build_plan(cfg, 80, 128)
    assert plan.step is not None
    line = format_plan(plan).splitlines()[-1]
    assert line.startswith(f"trainer step: about {plan.step.total_s:.1f} s (compute ")
    for assumed in ("38% MFU", "989 TFLOP/s", "45 GB/s pinned", "12 GB/s pageable", "host memory 50 GB/s"):
        assert assumed in line, assumed
    cpu = load_settled("configs/tiny_cpu.yaml")
    assert build_plan(cpu, 0.0, 0.0).step is None  # no GPU size: no estimate
