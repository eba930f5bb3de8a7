"""`auto` settings (runtime/memory/auto.py): for a GPU size given to the plan, the bench recipes
get settings that fit and are not smaller than needed; explicit values win; a config that fits
at no setting is refused naming its largest consumer; on CPU nothing changes; loading a recipe
(`load_config`) settles nothing, `load_settled` (what `tandem launch` loads with) does."""

from __future__ import annotations

import msgspec
import pytest

import runtime.memory.plan as memory_plan
from runtime.config import RunConfig
from runtime.config.load import AUTO_KEYS, load_config, to_yaml
from runtime.errors import ConfigError
from runtime.memory.auto import FAST_MICRO_BATCH, MAX_MICRO_BATCH, choose, load_settled, replace
from runtime.memory.estimate import model_shape, vllm_weights_gb
from runtime.memory.plan import build_plan, check_plan, format_plan, launch_plan

HOST = "memory.host_gb=128"  # a fixed host size, so no test depends on this machine's
RECIPES = ["bench_1.5b", "bench_3b", "bench_7b_lora"]


def _load(recipe: str, gpu_gb: float, *overrides: str) -> RunConfig:
    return load_settled(f"configs/{recipe}.yaml", [f"memory.gpu_gb={gpu_gb}", HOST, *overrides])


def _fits(cfg: RunConfig) -> bool:
    return not list(build_plan(cfg, cfg.memory.gpu_gb, cfg.memory.host_gb).problems())


@pytest.mark.parametrize("gpu_gb", [80, 141])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("staleness", [0, 2])
def test_each_recipe_fits_with_nothing_smaller_than_needed(recipe: str, gpu_gb: float, staleness: int) -> None:
    cfg = _load(recipe, gpu_gb, f"rollout.max_staleness={staleness}")
    assert _fits(cfg), format_plan(build_plan(cfg, gpu_gb, 128))
    mbt = cfg.trainer.micro_batch_tokens
    assert mbt == MAX_MICRO_BATCH or not _fits(replace(cfg, "trainer.micro_batch_tokens", 2 * mbt))
    # No lever that costs time is on where the run fits without it, even at the smallest micro-batch.
    smallest = replace(cfg, "trainer.micro_batch_tokens", 1024)
    for key in ("rollout.engine.sleep_when_idle", "trainer.offload.optimizer", "trainer.offload.params",
                "fsdp.cpu_offload"):  # fmt: skip
        if _get(cfg, key):
            assert not _fits(replace(smallest, key, False)), key
    # vLLM gets what its weights, workspace and the KV cache of every sequence need, no more.
    e, shape = cfg.rollout.engine, model_shape(cfg)
    full_kv = shape.kv_bytes_per_token() * e.max_model_len * e.max_num_seqs / 1e9
    need = vllm_weights_gb(cfg, shape) + 2.0 + full_kv
    assert need - full_kv / 2 <= e.gpu_memory_utilization * gpu_gb < need + 0.01 * gpu_gb


def test_the_1_5b_recipe_on_80_and_141_gb() -> None:
    """The issue's case: on 80 GB the default recipe was refused at 8192-token micro-batches
    beside vLLM's 0.3; vLLM's need is 0.16 of it, and 8192 then fits; 141 GB takes 16384."""
    h100, h200 = _load("bench_1.5b", 80), _load("bench_1.5b", 141)
    assert (h100.trainer.micro_batch_tokens, h100.rollout.engine.gpu_memory_utilization) == (8192, 0.16)
    assert (h200.trainer.micro_batch_tokens, h200.rollout.engine.gpu_memory_utilization) == (16384, 0.09)
    for cfg in (h100, h200):
        assert not cfg.rollout.engine.sleep_when_idle and not cfg.trainer.offload.optimizer
        assert not cfg.trainer.offload.params


def test_a_synchronous_run_that_fits_awake_does_not_sleep() -> None:
    awake = _load("bench_1.5b", 80, "rollout.max_staleness=0")
    assert not awake.rollout.engine.sleep_when_idle
    assert not build_plan(awake, 80, 128).gpus[0].rollout_sleeps
    assert any("fits beside an awake vLLM" in line for line in awake.memory.chosen)
    asleep = _load("bench_3b", 80, "rollout.max_staleness=0")  # 3B's step does not fit beside vLLM's 18 GB
    assert asleep.rollout.engine.sleep_when_idle and asleep.rollout.engine.sleep_level == 2
    assert _load("bench_7b_lora", 80, "rollout.max_staleness=0").rollout.engine.sleep_level == 1  # LoRA


def test_explicit_values_win_and_are_still_checked() -> None:
    pinned = _load("bench_1.5b", 80, "trainer.micro_batch_tokens=4096", "rollout.engine.gpu_memory_utilization=0.3")
    assert (pinned.trainer.micro_batch_tokens, pinned.rollout.engine.gpu_memory_utilization) == (4096, 0.3)
    assert not any(line.startswith(("trainer.micro_batch_tokens", "rollout.engine.gpu_memory_utilization"))
                   for line in pinned.memory.chosen)  # fmt: skip
    too_big = _load("bench_1.5b", 80, "trainer.micro_batch_tokens=65536")
    assert too_big.trainer.micro_batch_tokens == 65536
    with pytest.raises(ConfigError, match=r"^memory plan: GPU 0 of node 0 needs .*; it fits with "):
        check_plan(too_big, build_plan(too_big, 80, 128))
    awake = _load("bench_3b", 80, "rollout.max_staleness=0", "rollout.engine.sleep_when_idle=false")
    assert not awake.rollout.engine.sleep_when_idle  # kept: the other levers make room instead
    assert _load("bench_1.5b", 80, "rollout.engine.sleep_when_idle=auto").rollout.engine.sleep_when_idle is False


def test_a_config_that_fits_at_no_setting_is_refused_naming_the_largest_consumer() -> None:
    # Full-parameter 7B on 80 GB: only FSDP2's full offload fits the GPU, and its 122 GB of
    # master weights, gradients and moments do not fit a 100 GB host.
    cfg = _load("bench_7b", 80, "memory.host_gb=100")
    assert cfg.memory.chosen[0] == "nothing fits on 80.0 GB GPUs; planned with the most frugal settings"
    with pytest.raises(ConfigError) as info:
        check_plan(cfg, build_plan(cfg, 80, 100))
    line = str(info.value)
    assert "\n" not in line and line.startswith("memory plan: host memory of node 0: needs 1")
    assert "largest: trainer-0 122.8 GB (AdamW moments (2 x fp32, host; the CPU steps) 60.9 GB)" in line
    assert _fits(_load("bench_7b", 141))  # optimizer offload makes it fit there
    assert _load("bench_7b", 141).trainer.offload.optimizer


def test_full_parameter_7b_on_80_gb_takes_fsdp2_full_offload() -> None:
    """Where nothing else fits, FSDP2's full offload: master weights, gradients and moments in
    host memory; the GPU keeps the compute copy, the activations and the unit being reduced;
    micro-batches may grow past MAX_MICRO_BATCH (each one moves every gradient to the host)."""
    cfg = _load("bench_7b", 80)
    assert _fits(cfg)
    assert cfg.fsdp.cpu_offload and not cfg.trainer.offload.optimizer and not cfg.trainer.offload.params
    assert cfg.trainer.micro_batch_tokens == 32768 and not cfg.rollout.engine.sleep_when_idle
    assert cfg.rollout.engine.gpu_memory_utilization == 0.41  # the whole KV cache
    assert "fsdp.cpu_offload=true: nothing else fits" in " ".join(cfg.memory.chosen)
    plan = build_plan(cfg, 80, 128)
    trainer = next(p for g in plan.gpus for p in g.processes if p.name == "trainer-0")
    on_host = {i.what.split(" (")[0]: i.host_gb for i in trainer.items if i.host_gb}
    assert set(on_host) == {"master weights", "gradients", "AdamW moments"}
    assert on_host["AdamW moments"] == pytest.approx(60.9, abs=0.1)
    assert not any(i.gb for i in trainer.items if i.host_gb)  # none of them on the GPU
    assert 30 < trainer.trainer_peak < 40  # compute copy 15.2, activations, logits, weight sync
    assert not _fits(replace(cfg, "memory.host_gb", 100.0))  # the host is checked too
    # Synchronous, the same: no cheaper lever fits either.
    assert _load("bench_7b", 80, "rollout.max_staleness=0").fsdp.cpu_offload


def test_full_offload_is_not_chosen_where_something_else_fits() -> None:
    for recipe in RECIPES:
        for gpu_gb in (80, 141):
            assert not _load(recipe, gpu_gb).fsdp.cpu_offload, (recipe, gpu_gb)
    assert not _load("bench_7b", 141).fsdp.cpu_offload


def test_what_auto_chose_is_printed_and_recorded() -> None:
    cfg = _load("bench_1.5b", 80)
    text = format_plan(launch_plan(cfg, asks_gpus=True))
    assert "auto: trainer.micro_batch_tokens=8192: the largest that fits (16384 needs " in text
    assert "auto: rollout.engine.gpu_memory_utilization=0.16: vLLM's weights 3.1 GB" in text
    written = to_yaml(cfg)
    assert "micro_batch_tokens: 8192" in written and "trainer.micro_batch_tokens=8192: the largest" in written
    again = msgspec.convert(msgspec.to_builtins(cfg), RunConfig)  # what a role reads back: plain values
    assert again.trainer.micro_batch_tokens == 8192 and again.memory.chosen == cfg.memory.chosen


def test_cpu_runs_keep_the_cpu_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a GPU size every `auto` key takes RunConfig()'s value, as before `auto` was."""
    monkeypatch.setattr(memory_plan, "smallest_gpu_gb", lambda: 0.0)
    default = RunConfig()
    for recipe in ("configs/tiny_cpu.yaml", None, "configs/bench_1.5b.yaml"):
        cfg = load_settled(recipe)
        for key in AUTO_KEYS:
            assert _get(cfg, key) == _get(default, key), (recipe, key)
        assert cfg.memory.chosen == []
    cfg = load_settled("configs/tiny_cpu.yaml")
    assert choose(cfg, list(AUTO_KEYS), 0.0, 0.0)[0] == cfg


def test_loading_a_recipe_settles_nothing_and_load_settled_does() -> None:
    overrides = ["memory.gpu_gb=80", HOST]
    loaded = load_config("configs/bench_1.5b.yaml", overrides)
    assert loaded.memory.chosen == [] and loaded.trainer.micro_batch_tokens == RunConfig().trainer.micro_batch_tokens
    settled = load_settled("configs/bench_1.5b.yaml", overrides)
    assert len(settled.memory.chosen) == len(AUTO_KEYS)
    assert settled == _load("bench_1.5b", 80)
    given = load_settled("configs/bench_1.5b.yaml", [*overrides, "trainer.micro_batch_tokens=2048"])
    assert given.trainer.micro_batch_tokens == 2048  # a key given a value is kept as given


def test_auto_is_refused_where_nothing_chooses_it() -> None:
    with pytest.raises(ConfigError, match=r"reward\.judge\.engine\.gpu_memory_utilization"):
        load_settled(None, ["reward.judge.engine.gpu_memory_utilization=auto"])


def _get(cfg: object, dotted: str) -> object:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_a_lever_comes_before_a_micro_batch_below_the_floor() -> None:
    """The 3.09B recipe on an H100 (85.5 GB as nvidia-smi reports it): with everything awake
    and on the GPU only 1024-token micro-batches fit (6.6 % MFU measured); sleeping vLLM
    (synchronous) or half its KV cache (asynchronous) keeps 16384."""
    for staleness in (0, 2):
        cfg = load_settled("configs/bench_3b.yaml", [f"rollout.max_staleness={staleness}", "memory.gpu_gb=85.52"])
        assert cfg.trainer.micro_batch_tokens >= FAST_MICRO_BATCH, cfg.memory.chosen
        assert cfg.rollout.engine.sleep_when_idle == (staleness == 0)


def test_a_lora_run_keeps_vllm_awake() -> None:
    """vLLM's wake-up after an adapter update failed on the GPU, so `auto` never sleeps a
    LoRA run's vLLM: the 7.62B LoRA recipe, synchronous, on an H100 fits awake instead."""
    cfg = load_settled("configs/bench_7b_lora.yaml", ["rollout.max_staleness=0", "memory.gpu_gb=85.52"])
    assert cfg.rollout.engine.sleep_when_idle is False
    assert any("stays awake under LoRA" in line for line in cfg.memory.chosen)
    assert not list(build_plan(cfg, 85.52, 0.0).problems())
