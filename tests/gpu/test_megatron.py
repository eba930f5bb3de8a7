"""The Megatron-core trainer engine on 2 GPUs (megatron-core does not run forward on CPU).

    VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m pytest -m gpu tests/gpu/test_megatron.py -s -o addopts=""

* TP=2, and TP=1 with PP=2: the engine's token logprobs equal transformers' on the same HF
  weights (fp32: tight; bf16: within bf16 tolerance);
* one PPO step with Megatron TP=2 and with FSDP2 from the same weights and batch: same loss,
  gradient norm and update;
* the exported weights pushed into a vLLM rollout give the same greedy tokens as a fresh
  vLLM engine loading the HF directory written from them;
* an async GRPO run with a Megatron TP=2 trainer beside a vLLM rollout on the same 2 GPUs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.tiny.model import make_tiny_model
from tests.conftest import ROOT
from tests.gpu.test_gpu_run import GPU_ENGINE, launch
from tests.helpers.ports import free_port
from transport import wire

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2), pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny config's model (tied, vocabulary 259: TP=2 pads it) and an untied one."""
    root = tmp_path_factory.mktemp("megatron-models")
    return {
        "tied": make_tiny_model(root / "tied"),
        "untied": make_tiny_model(root / "untied", tie_word_embeddings=False),
    }


def torchrun(case: str, model_dir: Path, out: Path, *args: str) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "tests.gpu.megatron_worker", case, str(model_dir), str(out), *args]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
    result = json.loads((out / "result.json").read_text())
    print(json.dumps({k: v for k, v in result.items() if k != "update_rel_diff"}))
    return result


@pytest.mark.parametrize(
    ("model", "tp", "pp", "dtype", "max_abs"),
    [
        ("tied", 2, 1, "float32", 2e-3),
        ("untied", 1, 2, "float32", 2e-3),
        ("tied", 1, 2, "float32", 2e-3),
        ("tied", 2, 1, "bfloat16", 0.25),
    ],
)
def test_logprobs_equal_transformers(
    tiny: dict[str, Path], tmp_path: Path, model: str, tp: int, pp: int, dtype: str, max_abs: float
) -> None:
    r = torchrun("logprobs", tiny[model], tmp_path, str(tp), str(pp), dtype)
    assert r["lengths_match"] and r["sequences"] == 12
    assert r["max_abs_diff"] < max_abs, r
    if dtype == "bfloat16":
        assert r["mean_abs_diff"] < 0.03, r


@pytest.fixture(scope="module")
def ppo_step(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("megatron-ppo")
    return torchrun("ppo", tiny["tied"], out), out


def test_one_ppo_step_matches_fsdp2(ppo_step: tuple[dict, Path]) -> None:
    r, _ = ppo_step
    fsdp, mg = r["fsdp"], r["megatron"]
    assert mg["loss"] == pytest.approx(fsdp["loss"], rel=1e-4, abs=1e-6)
    assert mg["grad_norm"] == pytest.approx(fsdp["grad_norm"], rel=1e-3)
    assert mg["entropy"] == pytest.approx(fsdp["entropy"], rel=1e-4)
    assert r["exported"] == [n for n in r["fsdp_names"] if n != "lm_head.weight"]  # tied: written once
    assert r["update_rel_diff_max"] < 0.05, r["update_rel_diff"]


@pytest.mark.asyncio
async def test_exported_weights_in_vllm_equal_a_fresh_engine_on_the_export(
    ppo_step: tuple[dict, Path], tiny: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file

    from tests.gpu.test_weight_nccl import (
        MAX_TOKENS,
        PROMPTS,
        assert_fresh_engine_agrees,
        buckets_of,
        push,
        pusher_for,
        start_rollout,
    )
    from tests.helpers.harness import greedy

    _, out = ppo_step
    exported = load_file(out / "hf" / "model.safetensors")
    h = await start_rollout(tmp_path / "rollout", 0, f"model.path={tiny['tied']}")
    try:
        pusher = pusher_for(h, "zmq")
        assert h.peer is not None
        await pusher.set_targets([h.peer])
        try:
            result = await push(pusher, 1, buckets_of(exported, 64))
        finally:
            await pusher.aclose()
        assert not result.failed, result.failed
        assert (await h.next(wire.WeightsApplied)).version == 1
        tokens, logprobs, versions = await greedy(h, "exported", PROMPTS, MAX_TOKENS)
        assert versions == {1}
    finally:
        await h.stop()
    # The rollout above ran in this process and left CUDA initialised: a forked engine core
    # cannot use it ("Cannot re-initialize CUDA in forked subprocess").
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    await assert_fresh_engine_agrees(out / "hf", tokens, logprobs)
    shutil.rmtree(out / "hf", ignore_errors=True)


COLOCATED_TP2 = (
    "placement=[{role: controller}, {role: reward}, {role: rollout, devices: [0]},"
    " {role: trainer, count: 2, devices: [0, 1]}]"
)


def test_async_grpo_with_a_megatron_tp2_trainer(tmp_path: Path) -> None:
    overrides = (
        COLOCATED_TP2, "trainer.device=cuda", "trainer.backend=megatron", "fsdp.use_fsdp=false",
        "trainer.megatron.tensor_model_parallel_size=2", "rollout.max_staleness=2", "trainer.total_steps=8",
    )  # fmt: skip
    metrics = launch(tmp_path / "mg", *GPU_ENGINE, *overrides)
    assert len(metrics) == 8
    assert all(m["staleness_max"] <= 2 for m in metrics)
    assert all(m["loss"] == m["loss"] for m in metrics)  # no NaN
    logs = [json.loads(line) for line in (tmp_path / "mg" / "logs" / "trainer-0.jsonl").read_text().splitlines()]
    ready = [e for e in logs if e.get("event") == "engine_ready"]
    assert ready and ready[0]["backend"] == "megatron" and ready[0]["world_size"] == 2
