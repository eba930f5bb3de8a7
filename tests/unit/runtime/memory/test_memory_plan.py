"""The launch-time memory plan's arithmetic (runtime/memory/estimate.py, runtime/memory/plan.py):
parameter counts against real models, what each setting moves, the phases of a colocated
GPU, and the one-line refusal with a fix that fits."""

from __future__ import annotations

import pytest

from runtime.config.load import load_config
from runtime.errors import ConfigError
from runtime.memory.estimate import GB, MIB, ModelShape, model_shape, trainer_memory, weight_sync_items
from runtime.memory.plan import PROCESS_HOST_GB, build_plan, check_plan, format_plan, suggest_fix

H200_GB = 150.1  # 140 GiB, as nvidia-smi reports an H200
# Qwen2.5's published shapes and their Hugging Face parameter counts.
QWEN = {
    "1.5B": (ModelShape(1536, 28, 12, 2, 8960, 151936, True), 1_543_714_304),
    "3B": (ModelShape(2048, 36, 16, 2, 11008, 151936, True), 3_085_938_688),
    "7B": (ModelShape(3584, 28, 28, 4, 18944, 152064, False), 7_615_616_512),
}


@pytest.mark.parametrize("size", sorted(QWEN))
def test_parameter_count_of_qwen_shapes(size: str) -> None:
    shape, hf_count = QWEN[size]
    assert shape.num_params == hf_count


def test_parameter_count_equals_a_built_model(tmp_path) -> None:
    """The shape read from a config counts exactly the parameters transformers builds."""
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.tiny.model import make_tiny_model

    over = ["model.tiny.hidden_size=64", "model.tiny.num_layers=3", "model.tiny.num_heads=4",
            "model.tiny.num_kv_heads=2", "model.tiny.intermediate_size=96", "model.tiny.vocab_size=1000"]  # fmt: skip
    for tied in (True, False):
        cfg = load_config(None, [*over, f"model.tiny.tie_word_embeddings={str(tied).lower()}"])
        import msgspec

        path = make_tiny_model(tmp_path / f"m{tied}", **msgspec.structs.asdict(cfg.model.tiny))
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        built = sum(p.numel() for p in model.parameters())
        assert model_shape(load_config(None, [f"model.path={path}"])).num_params == built
        assert model_shape(cfg).num_params == built


# What the H200 recipes pinned before these keys were `auto` (runtime/memory/auto.py): the
# arithmetic below was checked against those values, on any machine.
PINNED = ["rollout.engine.sleep_when_idle=true", "rollout.engine.sleep_level=2", "trainer.offload.params=false"]
PINNED_1_5B = [*PINNED, "rollout.engine.gpu_memory_utilization=0.45", "trainer.micro_batch_tokens=8192",
               "trainer.offload.optimizer=false"]  # fmt: skip
PINNED_7B = [*PINNED, "rollout.engine.gpu_memory_utilization=0.25", "trainer.micro_batch_tokens=8192",
             "trainer.offload.optimizer=true"]  # fmt: skip


def _bench(*overrides: str):
    return load_config("configs/bench_1.5b.yaml", [*PINNED_1_5B, *overrides])


def _bench_7b(*overrides: str):
    return load_config("configs/bench_7b.yaml", [*PINNED_7B, *overrides])


def _items(cfg, world: int = 1) -> dict[str, float]:
    shape = model_shape(cfg)
    return {i.what.split(" (")[0]: i.gb for i in trainer_memory(cfg, shape, world)}


def test_trainer_state_by_dtype_and_shard() -> None:
    cfg = _bench()
    n = model_shape(cfg).num_params
    one = _items(cfg)
    assert one["master weights"] == pytest.approx(4 * n / GB)  # fsdp.param_dtype float32
    assert one["gradients"] == pytest.approx(4 * n / GB)  # reduce_dtype float32
    assert one["AdamW moments"] == pytest.approx(8 * n / GB)
    two = _items(cfg, world=2)
    for key in ("master weights", "gradients", "AdamW moments"):
        assert two[key] == pytest.approx(one[key] / 2)


def test_offload_moves_optimizer_state_to_the_host() -> None:
    cfg = _bench("trainer.offload.optimizer=true", "trainer.offload.chunk_mb=256")
    shape = model_shape(cfg)
    items = {i.what.split(" (")[0]: i for i in trainer_memory(cfg, shape, 1)}
    moments = items["AdamW moments"]
    assert moments.host_gb == pytest.approx(8 * shape.num_params / GB)
    assert moments.gb == pytest.approx(2 * 2 * 256 * MIB / GB)  # two streamed slots of two moments
    assert moments.phase == "step"


def test_activation_estimate_scales_with_tokens_and_checkpointing() -> None:
    small, big = _items(_bench("trainer.micro_batch_tokens=4096")), _items(_bench("trainer.micro_batch_tokens=8192"))
    assert big["activations"] == pytest.approx(2 * small["activations"])
    ckpt = _items(_bench("trainer.micro_batch_tokens=8192", "trainer.gradient_checkpointing=true"))
    assert ckpt["activations"] < big["activations"] / 5
    # The chunked head keeps one chunk's logits; the whole micro-batch's without it.
    whole = _items(_bench("trainer.micro_batch_tokens=8192", "trainer.logprob_chunk_tokens=0"))
    assert whole["LM head logits"] > 4 * big["LM head logits"]


def test_weight_sync_buffers_hold_the_largest_tensor() -> None:
    cfg = _bench("weight_sync.bucket_mb=64")
    shape = model_shape(cfg)
    buffers = weight_sync_items(cfg, shape, "ipc")[0]
    assert buffers.gb == pytest.approx(2 * shape.vocab * shape.hidden * 2 / GB)  # the embedding outgrows 64 MiB
    assert weight_sync_items(cfg, shape, "zmq") == []


def test_async_colocated_gpu_holds_everything_at_once() -> None:
    plan = build_plan(_bench(), H200_GB, 0.0)
    (gpu,) = plan.gpus
    assert [p.name for p in gpu.processes] == ["rollout-0", "trainer-0"]
    (phase, need), = gpu.phases().items()  # fmt: skip
    assert phase == "all at once"
    trainer = gpu.processes[1]
    vllm = 0.45 * H200_GB
    assert need == pytest.approx(vllm + trainer.trainer_peak * 1.05 + sum(p.context_gb for p in gpu.processes))
    assert not list(plan.problems())


def test_sync_colocated_gpu_has_a_step_phase_and_an_update_phase() -> None:
    plan = build_plan(_bench("rollout.max_staleness=0"), H200_GB, 0.0)
    (gpu,) = plan.gpus
    assert gpu.rollout_sleeps
    phases = gpu.phases()
    assert set(phases) == {"trainer steps, vLLM asleep", "weight update and generation"}
    # vLLM's share is held only while it is awake, and then the trainer holds no step memory.
    assert phases["weight update and generation"] > 0.45 * H200_GB
    assert phases["trainer steps, vLLM asleep"] < phases["weight update and generation"] + 40
    sync_total = max(phases.values())
    async_total = build_plan(_bench(), H200_GB, 0.0).gpus[0].phases()["all at once"]
    assert sync_total < async_total


def test_a_run_that_cannot_fit_is_refused_in_one_line_with_a_fix_that_fits() -> None:
    eager = ("trainer.micro_batch_tokens=16384", "trainer.compile=false")  # the recipe that died at step 3
    cfg = _bench(*eager)
    plan = build_plan(cfg, H200_GB, 0.0)
    with pytest.raises(ConfigError) as info:
        check_plan(cfg, plan)
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith("memory plan: GPU 0 of node 0 needs ")
    assert "largest: rollout-0 vLLM (gpu_memory_utilization 0.45) 67.5 GB" in line
    fix = line.split("it fits with ")[1].split(" (tandem launch --plan")[0]
    fixed = _bench(*eager, *fix.split())
    assert not list(build_plan(fixed, H200_GB, 0.0).problems()), fix


def test_no_fix_is_offered_when_none_fits() -> None:
    cfg = _bench_7b()
    assert suggest_fix(cfg, 20.0, 0.0).startswith("no single setting makes it fit")


def test_host_memory_is_planned_and_checked() -> None:
    cfg = _bench_7b()
    plan = build_plan(cfg, H200_GB, 64.0)
    problems = list(plan.problems())
    assert problems and problems[0].startswith("host memory of node 0: needs ")
    assert "AdamW moments (host, streamed)" in problems[0]  # 61 GB of moments, the largest
    assert not list(build_plan(cfg, H200_GB, 256.0).problems())


def test_the_trainers_host_memory_is_what_it_offloads_and_its_own() -> None:
    """`trainer_host_gb` (what a run's `host_peak_gb` is compared with): the optimizer's moments
    the offload keeps on the host, plus the process's own; only its own without offload."""
    offloaded = build_plan(_bench_7b(), H200_GB, 256.0)
    moments = next(i for g in offloaded.gpus for p in g.processes if p.name == "trainer-0" for i in p.items
                    if i.what.startswith("AdamW moments"))  # fmt: skip
    assert moments.host_gb > 50
    assert offloaded.trainer_host_gb() == pytest.approx(moments.host_gb + PROCESS_HOST_GB, rel=1e-6)
    assert build_plan(_bench(), H200_GB, 256.0).trainer_host_gb() == pytest.approx(PROCESS_HOST_GB)


def test_the_table_names_every_consumer_and_the_verdict() -> None:
    text = format_plan(build_plan(_bench("rollout.max_staleness=0"), H200_GB, 0.0))
    assert text.startswith("memory plan: 1.54B-parameter policy (hidden 1536, 28 layers, vocabulary 151936)")
    for what in ("master weights", "AdamW moments", "activations", "LM head logits", "weight-sync buffers",
                 "vLLM (gpu_memory_utilization 0.45)", "vLLM asleep", "peak (cuda_peak_gb)"):  # fmt: skip
        assert what in text, what
    assert "= trainer steps, vLLM asleep: " in text and "fits" in text


def test_unknown_gpu_size_is_planned_but_not_checked() -> None:
    plan = build_plan(_bench("trainer.micro_batch_tokens=65536"), 0.0, 0.0, on_gpus=True)
    assert not list(plan.problems())
    assert "unchecked" in format_plan(plan)


def test_kv_cache_smaller_than_one_sequence_is_a_problem() -> None:
    cfg = _bench_7b("rollout.engine.gpu_memory_utilization=0.1")
    problems = list(build_plan(cfg, H200_GB, 0.0).problems())
    assert any(p.startswith("rollout: gpu_memory_utilization 0.1 ") for p in problems), problems


def test_pinned_host_memory_rounds_to_a_power_of_two() -> None:
    """torch's pinned allocator (vLLM's sleep backup) takes the next power of two: 2.02x
    measured on torch 2.11 for the 7B MLP's 271.6 MB fp32 tensor."""
    from runtime.memory.estimate import pinned_bytes

    assert pinned_bytes(18944 * 3584 * 4) == 1 << 29
    assert pinned_bytes(1 << 20) == 1 << 20 and pinned_bytes((1 << 20) + 1) == 1 << 21 and pinned_bytes(0) == 0
    cfg = _bench_7b("rollout.max_staleness=0", "rollout.engine.sleep_level=1")
    plan = build_plan(cfg, 150.8, 137.4)
    backup = dict(plan.host[0])["rollout-0"]
    assert 30.0 < backup < 33.0  # 15.2 GB of bf16 weights pinned tensor by tensor (28.7), and the process (3.0)


def test_sleep_level_2_keeps_no_host_copy_of_the_weights() -> None:
    """At level 2 (the default) a sleeping vLLM discards its weights: its host share is the
    process alone, and the GPU phases are those of level 1. Adapter runs sleep at level 1."""
    from runtime.memory.estimate import sleep_level

    sync = ["rollout.max_staleness=0"]
    level2 = build_plan(_bench_7b(*sync), 150.8, 137.4)
    level1 = build_plan(_bench_7b(*sync, "rollout.engine.sleep_level=1"), 150.8,
                        137.4)  # fmt: skip
    assert dict(level2.host[0])["rollout-0"] == pytest.approx(dict(level1.host[0])["rollout-0"] - 28.7, abs=0.5)
    assert level2.gpus[0].phases() == level1.gpus[0].phases()
    assert "vLLM asleep (level 2: weights discarded)" in format_plan(level2)
    assert sleep_level(_bench_7b("trainer.lora.rank=16")) == 1
    assert sleep_level(_bench_7b()) == 2


def test_lora_trains_and_sends_only_the_adapters() -> None:
    """Under LoRA the head is frozen (no float32 head-weight gradient) and only the adapters
    travel (81 MB at 7B, rank 16): buckets of that size, not 1 GiB. The 7B LoRA run measured a
    51.6 GB peak on one H200 (BENCHMARKS.md) with its frozen base in float32; the plan said 54.8
    GB before counting this. The base is now kept in bfloat16 (roles/training/peft_lora.py), 2
    bytes a frozen parameter less."""
    full, lora = _bench_7b(), _bench_7b("trainer.lora.rank=16", "trainer.offload.optimizer=false")
    shape = model_shape(full)
    head_grad = _items(full)["LM head logits"] - _items(lora)["LM head logits"]
    assert head_grad == pytest.approx(shape.vocab * shape.hidden * 4 / GB)
    adapters = shape.lora_params(16, lora.trainer.lora.target_modules) * 2
    assert adapters == pytest.approx(81e6, rel=0.01)
    assert weight_sync_items(lora, shape, "ipc")[0].gb == pytest.approx(2 * adapters / GB)
    frozen = (shape.num_params - adapters / 2) * 2 / GB
    assert build_plan(lora, 150.8, 0.0).trainer_peak_gb() == pytest.approx(51.6 - frozen, rel=0.04)


def test_a_lora_base_is_planned_in_the_compute_dtype_with_the_allocators_larger_slack() -> None:
    """Under LoRA with mixed precision the frozen base is held in bfloat16 and only the adapters in
    float32 (what roles/trainer/fsdp_engine.py stores); without mixed precision everything stays in
    fsdp.param_dtype. A LoRA trainer's allocator slack is LORA_ALLOCATOR_SLACK of what its step adds
    to its resident memory (the measured 7B LoRA trainer ran out of memory inside 5 %)."""
    from runtime.memory.estimate import LORA_ALLOCATOR_SLACK

    lora = _bench_7b("trainer.lora.rank=16", "trainer.offload.optimizer=false")
    shape = model_shape(lora)
    adapters = shape.lora_params(16, lora.trainer.lora.target_modules)
    master = _items(lora)["master weights"]
    assert master == pytest.approx((adapters * 4 + (shape.num_params - adapters) * 2) / GB)
    assert "frozen base" in format_plan(build_plan(lora, 80.0, 0.0))
    unmixed = _bench_7b("trainer.lora.rank=16", "trainer.offload.optimizer=false", "fsdp.mixed_precision=null")
    assert _items(unmixed)["master weights"] == pytest.approx(shape.num_params * 4 / GB)
    assert _items(_bench_7b())["master weights"] == pytest.approx(shape.num_params * 4 / GB)

    trainer = next(p for p in build_plan(lora, 80.0, 0.0).gpus[0].processes if p.role == "trainer")
    assert trainer.lora
    step = trainer.trainer_peak - trainer.held("always")
    assert trainer.allocator_slack_gb == pytest.approx(LORA_ALLOCATOR_SLACK * step)
    full = next(p for p in build_plan(_bench_7b(), 150.8, 0.0).gpus[0].processes if p.role == "trainer")
    assert not full.lora and full.allocator_slack_gb == pytest.approx(0.05 * full.trainer_peak)


def test_a_compiled_actor_is_planned_with_the_activations_it_keeps() -> None:
    """trainer.compile (auto: the full-parameter actor with torch's kernels, on a GPU) keeps
    0.70 of the eager activations; LoRA and Liger runs stay eager, and so does the plan."""
    eager = _items(_bench("trainer.compile=false"))["activations"]
    assert _items(_bench("trainer.compile=auto"))["activations"] == pytest.approx(0.70 * eager)
    assert _items(_bench("trainer.compile=true"))["activations"] == pytest.approx(0.70 * eager)
    assert _items(_bench("trainer.compile=auto", "trainer.lora.rank=16"))["activations"] == pytest.approx(eager)
    assert _items(_bench("trainer.compile=auto", "trainer.kernels=liger"))["activations"] == pytest.approx(eager)


def test_each_process_is_planned_with_what_nvidia_smi_will_count_for_it() -> None:
    """`Plan.process_gb`: a vLLM rollout's share, its LoRA extra and its context; a trainer's peak,
    its allocator slack and its context (what benchmarks/async_vs_sync.py sets beside nvidia-smi's
    figure for each role)."""
    from runtime.memory.estimate import CUDA_CONTEXT_GB, VLLM_CONTEXT_GB, VLLM_LORA_GB

    cfg = load_config("configs/bench_7b_lora.yaml", [*PINNED_7B, "trainer.lora.rank=16"])
    plan = build_plan(cfg, 85.52, 0.0)
    trainer = next(p for p in plan.gpus[0].processes if p.name == "trainer-0")
    assert plan.process_gb() == pytest.approx(
        {
            "rollout-0": 0.25 * 85.52 + VLLM_LORA_GB + VLLM_CONTEXT_GB,
            "trainer-0": trainer.trainer_peak + trainer.allocator_slack_gb + CUDA_CONTEXT_GB,
        }
    )
    assert build_plan(cfg, 0.0, 0.0).process_gb() == {}  # a GPU of unknown size: nothing to compare
