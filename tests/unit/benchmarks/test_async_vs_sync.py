"""benchmarks/async_vs_sync.py: its summary of a metrics.jsonl (checked against figures
worked out by hand), the headline comparison, the policy's parameter count, the variants'
overrides (the colocated placement included) and its command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.async_vs_sync import (
    colocated_placement,
    compare,
    decoder_param_count,
    parse_args,
    read_metrics,
    rounded,
    summarize_run,
    variant_overrides,
)
from benchmarks.gpu_process_peaks import PeakSampler
from runtime.config.load import load_config
from runtime.errors import ConfigError
from runtime.memory.gpu import GpuProcess
from runtime.preflight.environment import check_launch
from tests.conftest import ROOT

BENCH = ROOT / "configs" / "bench_h200x2.yaml"


def _step(step: int, step_s: float, samples_per_s: float, tokens_per_s: float, **kw: float) -> dict[str, float]:
    rec = {"step": step, "step_s": step_s, "samples_per_s": samples_per_s, "tokens_per_s": tokens_per_s}
    rec.update(gen_busy_s=0.0, train_busy_s=0.0, weight_sync_s=0.0, staleness_mean=0.0, staleness_max=0)
    return {**rec, **kw}


# Two warm-up steps with absurd figures (they must not count), then two measured steps:
# step 3: 2 s, 64 samples, 1024 tokens; step 4: 4 s, 64 samples, 1024 tokens.
RECORDS = [
    _step(1, 100.0, 1.0, 1.0, gen_busy_s=99.0, train_busy_s=1.0, weight_sync_s=50.0, wall_s=100.0, dropped_stale=99),
    _step(2, 50.0, 1.0, 1.0, gen_busy_s=1.0, train_busy_s=49.0, weight_sync_s=50.0, wall_s=150.0,
          kl_behaviour_proximal=1.4),
    _step(3, 2.0, 32.0, 512.0, gen_busy_s=1.5, train_busy_s=1.0, weight_sync_s=0.2, weight_sync_gb=0.5,
          staleness_mean=1.0, staleness_max=2, wall_s=152.0, kl_behaviour_proximal=3e-4),
    _step(4, 4.0, 16.0, 256.0, gen_busy_s=3.5, train_busy_s=1.0, weight_sync_s=0.4, weight_sync_gb=0.7,
          staleness_mean=2.0, staleness_max=2, wall_s=156.0, dropped_stale=16),
]  # fmt: skip


def _summary(path: Path) -> dict:
    path.write_text("".join(json.dumps(r) + "\n" for r in reversed(RECORDS)) + "\n")
    return summarize_run(
        read_metrics(path), warmup=2, params=10**9, policy_bytes=3 * 10**9, prompt_tokens=10.0, peak_flops=1e14
    )


def test_summary_of_a_metrics_file(tmp_path: Path) -> None:
    s = _summary(tmp_path / "metrics.jsonl")
    assert s["steps"] == 2
    assert s["wall_s"] == pytest.approx(6.0)  # 2 + 4
    assert s["run_wall_s"] == pytest.approx(156.0)
    assert s["run_samples_per_s"] == pytest.approx((100 + 50 + 64 + 64) / 156)  # every step counts
    assert s["samples_per_s"] == pytest.approx(128 / 6)
    assert s["tokens_per_s"] == pytest.approx(2048 / 6)
    assert s["response_tokens_mean"] == pytest.approx(2048 / 128)
    # 16 samples dropped as stale in step 4 (the warm-up's 99 do not count): 16 of 16 + 128
    assert (s["dropped_stale"], s["dropped_stale_fraction"]) == (16, pytest.approx(16 / 144))
    assert s["step_s_median"] == pytest.approx(3.0)
    assert (s["gen_busy_s"], s["train_busy_s"]) == pytest.approx((5.0, 2.0))
    assert s["wall_over_max_busy"] == pytest.approx(6 / 5)
    assert s["rollout_idle_ratio"] == pytest.approx(1 / 6)
    assert s["trainer_idle_ratio"] == pytest.approx(4 / 6)
    assert s["weight_sync_s"] == pytest.approx(0.3)  # median of 0.2 and 0.4
    assert s["weight_sync_gbps"] == pytest.approx(10.0)  # 3 GB in 0.3 s
    assert s["weight_sync_gb_pushed"] == pytest.approx(0.6)
    # 6 * 1e9 params * (2048 response + 128 * 10 prompt tokens) / 2 s busy / 1e14 FLOP/s
    assert s["trainer_mfu"] == pytest.approx(6e9 * 3328 / 2 / 1e14)
    assert (s["staleness_mean"], s["staleness_max"]) == (pytest.approx(1.5), 2)
    assert s["kl_behaviour_proximal_max"] == 1.4  # warm-up steps count: a wrong update shows at once


def test_the_last_steps_can_be_left_out() -> None:
    # An async run trains its last max_staleness steps on samples generated ahead: cooldown drops them.
    s = summarize_run(RECORDS, warmup=2, cooldown=1, params=1, policy_bytes=2, prompt_tokens=0.0, peak_flops=1.0)
    assert (s["steps"], s["wall_s"], s["samples_per_s"], s["weight_sync_s"]) == (1, 2.0, 32.0, 0.2)
    assert s["run_wall_s"] == 156.0


def test_trainer_mfu_alone_counts_the_steps_without_generation() -> None:
    """An async run's last steps train samples generated ahead, with no generation beside the
    trainer: their MFU is the trainer's own, the window's is the trainer's beside vLLM."""
    last = _step(5, 1.0, 64.0, 1024.0, gen_busy_s=0.0, train_busy_s=0.5, weight_sync_s=0.2, wall_s=157.0)
    s = summarize_run([*RECORDS, last], warmup=2, cooldown=1, params=10**9, policy_bytes=1, prompt_tokens=10.0,
                      peak_flops=1e14)  # fmt: skip
    # 6 * 1e9 * (1024 response + 64 * 10 prompt tokens) / 0.5 s busy / 1e14
    assert s["trainer_mfu_alone"] == pytest.approx(6e9 * 1664 / 0.5 / 1e14)
    assert s["trainer_mfu"] == pytest.approx(6e9 * 3328 / 2 / 1e14)  # the window (steps 3-4) as before
    assert _summary_of(RECORDS)["trainer_mfu_alone"] is None  # every step generated


def _summary_of(records: list[dict]) -> dict:
    return summarize_run(records, warmup=2, params=1, policy_bytes=2, prompt_tokens=0.0, peak_flops=1.0)


def test_summary_needs_steps_after_the_warm_up() -> None:
    with pytest.raises(ValueError, match="2 steps recorded, none left without 2 warm-up and 0 last steps"):
        summarize_run(RECORDS[:2], warmup=2, params=1, policy_bytes=2, prompt_tokens=0.0, peak_flops=1.0)
    with pytest.raises(ValueError, match="4 steps recorded, none left without 2 warm-up and 2 last steps"):
        summarize_run(RECORDS, warmup=2, cooldown=2, params=1, policy_bytes=2, prompt_tokens=0.0, peak_flops=1.0)


def test_idle_ratio_is_never_negative() -> None:
    busy = [_step(1, 2.0, 1.0, 1.0, gen_busy_s=3.0, train_busy_s=2.5, weight_sync_s=0.1, wall_s=2.0)]
    s = summarize_run(busy, warmup=0, params=1, policy_bytes=2, prompt_tokens=0.0, peak_flops=1.0)
    assert (s["rollout_idle_ratio"], s["trainer_idle_ratio"]) == (0.0, 0.0)
    assert s["kl_behaviour_proximal_max"] is None  # a run that logged none
    assert s["wall_over_max_busy"] == pytest.approx(2 / 3)


def test_compare_async_with_sync_and_colocated() -> None:
    a = {"samples_per_s": 30.0, "wall_over_max_busy": 1.1, "weight_sync_s": 0.5, "weight_sync_gbps": 5.2}
    a.update(trainer_mfu=0.31, tokens_per_s=3000.0, dropped_stale_fraction=0.15)
    # async trains more, shorter samples: 1.5x the samples/s, 1.2x the tokens/s
    variants = {"sync": {"samples_per_s": 20.0, "tokens_per_s": 2500.0}, "async": a,
                "colocated": {"samples_per_s": 24.0}}  # fmt: skip
    out = compare(variants, {"role_over_bare": 0.97, "bare_vllm_tokens_per_s": 1000.0})
    assert out == {
        "speedup": pytest.approx(1.5),
        "speedup_tokens": pytest.approx(1.2),
        "async_dropped_stale_fraction": 0.15,
        "speedup_vs_colocated": pytest.approx(1.25),
        "wall_over_max_busy": 1.1,
        "weight_sync_s": 0.5,
        "weight_sync_gbps": 5.2,
        "trainer_mfu": 0.31,
        "rollout_vs_bare_vllm": 0.97,
    }
    del variants["colocated"]
    out = compare(variants, None)
    assert "speedup_vs_colocated" not in out and out["rollout_vs_bare_vllm"] is None


def test_param_count_of_the_bench_shape_by_hand() -> None:
    hf = {"model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12}
    hf.update(num_key_value_heads=2, intermediate_size=8960, vocab_size=259, tie_word_embeddings=True)
    # per layer: q 1536*1536+1536, k and v 1536*256+256 each, o 1536*1536, MLP 3*1536*8960, 2 norms
    layer = (1536 * 1536 + 1536) + 2 * (1536 * 256 + 256) + 1536 * 1536 + 3 * 1536 * 8960 + 2 * 1536
    assert layer == 46_797_824
    assert decoder_param_count(hf) == 259 * 1536 + 28 * layer + 1536 == 1_310_738_432
    untied = {**hf, "tie_word_embeddings": False}
    assert decoder_param_count(untied) - decoder_param_count(hf) == 259 * 1536
    llama = {**hf, "model_type": "llama"}  # no attention biases
    assert decoder_param_count(hf) - decoder_param_count(llama) == 28 * (1536 + 256 + 256)


def test_param_count_matches_the_tiny_models_weights(tiny_model_dir: Path) -> None:
    from safetensors import safe_open

    numel = 0
    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            shape = f.get_slice(name).get_shape()
            n = 1
            for dim in shape:
                n *= dim
            numel += n
    hf = json.loads((tiny_model_dir / "config.json").read_text())
    assert decoder_param_count(hf) == numel == 329_216


def test_colocated_placement_shares_every_gpu() -> None:
    cfg = load_config(BENCH)
    assert colocated_placement(cfg) == [
        {"role": "controller"},
        {"role": "reward"},
        {"role": "rollout", "count": 2, "devices": [0, 1]},
        {"role": "trainer", "count": 2, "devices": [0, 1]},
    ]
    with pytest.raises(ValueError, match="puts no role on a GPU"):
        colocated_placement(load_config(ROOT / "configs" / "tiny_cpu.yaml"))


def test_variant_overrides_load_as_configs() -> None:
    base = load_config(BENCH)
    plans = variant_overrides(base, staleness=3, colocated_util=0.5)
    assert list(plans) == ["sync", "async", "colocated"]
    sync, async_, colo = (load_config(BENCH, ["trainer.total_steps=4", *plans[k]]) for k in plans)
    assert (sync.rollout.max_staleness, async_.rollout.max_staleness, colo.rollout.max_staleness) == (0, 3, 0)
    assert sync.placement == base.placement == async_.placement
    assert [(e.role, e.count, e.devices) for e in colo.placement if e.devices] == [
        ("rollout", 2, [0, 1]),
        ("trainer", 2, [0, 1]),
    ]
    assert colo.rollout.engine.gpu_memory_utilization == 0.5 and colo.trainer.total_steps == 4
    assert colo.weight_sync.backend == "auto" and async_.weight_sync.backend == base.weight_sync.backend
    check_launch(colo)
    too_greedy = variant_overrides(base, staleness=2, colocated_util=0.9)["colocated"]
    with pytest.raises(ConfigError, match="GPU 0 of node 0 is over-committed"):
        check_launch(load_config(BENCH, too_greedy))
    assert list(variant_overrides(base, staleness=2, colocated_util=None)) == ["sync", "async"]


def test_command_line_and_rounding() -> None:
    args = parse_args(["--config", "configs/tiny_cpu.yaml", "trainer.total_steps=4", "--colocated", "rollout.n=4"])
    assert (args.config, args.colocated) == ("configs/tiny_cpu.yaml", True)
    assert args.overrides == ["trainer.total_steps=4", "rollout.n=4"]
    assert rounded({"a": [1 / 3, 2], "b": 123456.789, "c": None}) == {"a": [0.3333, 2], "b": 123500.0, "c": None}


def test_reuse_summarises_a_finished_variant_instead_of_running_it(tmp_path: Path, monkeypatch) -> None:
    """`--reuse`: a variant whose run directory holds all its steps is read, not launched
    again; one that holds fewer (it died, or never ran) is launched."""
    import benchmarks.async_vs_sync as bench

    launched: list[str] = []
    monkeypatch.setattr(bench, "launch", lambda config, overrides, log, timeout, env: launched.append(log.stem) or 1.0)
    monkeypatch.setattr(bench, "memory_figures", lambda cfg, records: {"plan_process_gb": {"rollout-0": 20.0}})
    seen = PeakSampler(sample=lambda: [GpuProcess(7, 21.0, "rollout-0 (VLLM::EngineCore)")])
    monkeypatch.setattr(bench, "PeakSampler", lambda: seen)  # one reading of a GPU this machine lacks
    policy = bench.Policy(params=10**9, prompt_tokens=10.0, overrides=[])
    args = parse_args(["--config", "configs/tiny_cpu.yaml", "--reuse"])
    for name, steps in (("done", 4), ("short", 3)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:steps]))
    done = bench.run_variant(Path("configs/tiny_cpu.yaml"), [f"run_dir={tmp_path / 'done'}", "trainer.total_steps=4"],
                             args, policy, reuse=args.reuse)  # fmt: skip
    assert launched == [] and done["launch_s"] is None and done["steps"] == 1  # 2 warm-up, 1 cool-down
    short = bench.run_variant(Path("configs/tiny_cpu.yaml"), [f"run_dir={tmp_path / 'short'}", "trainer.total_steps=4"],
                              args, policy, reuse=True)  # fmt: skip
    assert launched == ["short"] and short["launch_s"] == 1.0
    assert short["gpu_process_peak_gb"] == {"rollout-0": 21.0} and short["process_over_plan"] == {"rollout-0": 1.05}
    (tmp_path / "short" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:4]))
    again = bench.run_variant(Path("configs/tiny_cpu.yaml"), [f"run_dir={tmp_path / 'short'}", "trainer.total_steps=4"],
                              args, policy, reuse=True)  # fmt: skip
    assert launched == ["short"] and again["launch_s"] == 1.0  # the launching invocation's figure, read back
    assert again["gpu_process_peak_gb"] == {"rollout-0": 21.0}  # and its GPU peaks
    assert done["gpu_process_peak_gb"] is None and done["process_over_plan"] is None  # nothing recorded


def test_the_plans_step_time_is_recorded_beside_the_measured_one() -> None:
    import benchmarks.async_vs_sync as bench

    figures = bench.step_time_figures(30.0, {"train_busy_s": 240.0, "steps": 10})
    assert figures == {"train_s_per_step": 24.0, "plan_over_measured_train_s": 1.25}
    assert bench.step_time_figures(None, {"train_busy_s": 240.0, "steps": 10})["plan_over_measured_train_s"] is None


def test_the_trainers_host_peak_is_reported_beside_the_plans(tmp_path: Path) -> None:
    """`host_peak_gb` (the trainer's resident high-water mark) is the run's largest, beside the
    plan's host memory for trainer rank 0 and their ratio; a run without it reports None."""
    import benchmarks.async_vs_sync as bench

    cfg = load_config("configs/tiny_cpu.yaml", [f"run_dir={tmp_path}"])
    out = bench.memory_figures(cfg, [{"host_peak_gb": 1.5}, {"host_peak_gb": 2.0}, {}])
    assert out["host_peak_gb"] == 2.0 and out["plan_trainer_host_gb"] > 0
    assert out["plan_over_measured_host"] == pytest.approx(out["plan_trainer_host_gb"] / 2.0)
    assert bench.memory_figures(cfg, [{}])["host_peak_gb"] is None
