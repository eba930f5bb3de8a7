"""Routing replay on a real (tiny, random) HF Qwen3-MoE: the replayed forward against a
hand-routed reference, gradients through the replayed experts, the agreement metrics, and
the expert tensors by checkpoint name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from roles.training.moe import MoeRouting, checkpoint_items, find_routers, is_moe


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from runtime.tiny.model import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("moe") / "tiny_moe", hidden_size=64, num_heads=2, num_experts=8, initializer_range=0.2
    )


def _load(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _own_routing(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[N, L, k]: the experts each layer's router picks for each token, recorded from HF's own forward."""
    picks: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, i, o: picks.append(o[2].detach())) for r in find_routers(model)]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return torch.stack(picks, dim=1)


def _hand_routed_mlp(block: torch.nn.Module, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """One sparse MoE block by hand: each token through exactly `experts` [N, k], weighted by
    the router's softmax at those experts, renormalised."""
    gate, ex = block.gate, block.experts
    probs = torch.softmax(F.linear(x, gate.weight).float(), dim=-1)
    w = probs.gather(-1, experts)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[n, j])
            g, u = F.linear(x[n], ex.gate_up_proj[e]).chunk(2, dim=-1)
            out[n] += w[n, j].to(x.dtype) * F.linear(F.silu(g) * u, ex.down_proj[e])
    return out


def test_tiny_moe_is_a_qwen3_moe(moe_dir: Path) -> None:
    model = _load(moe_dir)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert is_moe(model) and len(find_routers(model)) == 2
    routing = MoeRouting(model)
    assert (routing.num_layers, routing.top_k, routing.num_experts) == (2, 2, 8)


def test_replayed_block_equals_the_hand_routed_reference(moe_dir: Path) -> None:
    model = _load(moe_dir)
    block = model.model.layers[0].mlp
    routing = MoeRouting(model)
    x = torch.randn(1, 6, 64)
    forced = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [7, 0], [3, 5]])
    experts = torch.stack([forced, forced], dim=1)  # [N, L, k]: the same for both layers
    with routing.micro_batch(experts, torch.ones(6), replay=True), torch.no_grad():
        got = block(x)[0]
    want = _hand_routed_mlp(block, x[0], forced)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # outside the block the router is HF's own again
        own = torch.topk(torch.softmax(F.linear(x[0], block.gate.weight), -1), 2).indices
        torch.testing.assert_close(block(x)[0], _hand_routed_mlp(block, x[0], own), rtol=1e-5, atol=1e-6)


def test_rows_without_rollout_experts_route_themselves(moe_dir: Path) -> None:
    model = _load(moe_dir)
    block = model.model.layers[0].mlp
    routing = MoeRouting(model)
    x = torch.randn(1, 4, 64)
    own = torch.topk(torch.softmax(F.linear(x[0], block.gate.weight), -1), 2).indices
    forced = (own + 1) % 8  # never the router's own choice
    mask = torch.tensor([1, 0, 1, 0])
    with routing.micro_batch(torch.stack([forced, forced], 1), mask, replay=True), torch.no_grad():
        got = block(x)[0]
    chosen = torch.where(mask.bool()[:, None], forced, own)
    torch.testing.assert_close(got, _hand_routed_mlp(block, x[0], chosen), rtol=1e-5, atol=1e-6)


def test_gradients_reach_the_router_through_the_replayed_experts(moe_dir: Path) -> None:
    model = _load(moe_dir)
    block = model.model.layers[0].mlp
    routing = MoeRouting(model)
    x = torch.randn(1, 5, 64)
    forced = torch.tensor([[0, 1], [0, 2], [1, 2], [0, 1], [2, 0]])  # experts 3..7 never used
    with routing.micro_batch(torch.stack([forced, forced], 1), torch.ones(5), replay=True):
        block(x).sum().backward()
    got_gate, got_up = block.gate.weight.grad.clone(), block.experts.gate_up_proj.grad.clone()
    assert got_gate.abs().sum() > 0
    assert got_up[:3].abs().sum() > 0 and got_up[3:].abs().sum() == 0  # only the replayed experts learn
    block.zero_grad()
    _hand_routed_mlp(block, x[0], forced).sum().backward()
    torch.testing.assert_close(got_gate, block.gate.weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_up, block.experts.gate_up_proj.grad, rtol=1e-4, atol=1e-5)


def test_replaying_the_trainers_own_routing_changes_nothing_and_measures_zero(moe_dir: Path) -> None:
    model = _load(moe_dir)
    routing = MoeRouting(model)
    ids = torch.randint(0, 259, (1, 12))
    own = _own_routing(model, ids)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with routing.micro_batch(own, torch.ones(12), replay=True) as out:
            replayed = model(input_ids=ids).logits
    torch.testing.assert_close(replayed, plain)
    (stats,) = out
    assert (float(stats.compared), float(stats.disagree), float(stats.mismatch)) == (12.0, 0.0, 0.0)
    assert float(stats.aux_loss) >= 0.999 * routing.top_k  # top_k when perfectly balanced, more otherwise


def test_disagreement_is_measured_with_and_without_replay(moe_dir: Path) -> None:
    model = _load(moe_dir)
    routing = MoeRouting(model)
    ids = torch.randint(0, 259, (1, 10))
    other = _own_routing(model, ids).clone()
    other[:4, 1] = (other[:4, 1] + 1) % 8  # rows 0-3 disagree in the second layer
    for replay, mismatch in ((False, 4.0), (True, 0.0)):
        with torch.no_grad(), routing.micro_batch(other, torch.ones(10), replay=replay) as out:
            model(input_ids=ids)
        assert (float(out[0].disagree), float(out[0].mismatch)) == (4.0, mismatch)


def test_wrong_shape_is_refused_naming_the_layers(moe_dir: Path) -> None:
    routing = MoeRouting(_load(moe_dir))
    with pytest.raises(ValueError, match="2 MoE layers of top-2"), routing.micro_batch(torch.zeros(3, 5, 2)):
        pass


def test_checkpoint_items_are_the_names_and_tensors_transformers_saves(moe_dir: Path) -> None:
    from safetensors import safe_open

    model = _load(moe_dir)
    items = dict(kv for name, t in model.state_dict().items() for kv in checkpoint_items(name, t))
    with safe_open(str(moe_dir / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    assert set(items) - {"lm_head.weight"} == set(saved)
    for name, tensor in saved.items():
        torch.testing.assert_close(items[name].to(tensor.dtype), tensor, msg=name)


@pytest.mark.parametrize("replay", [False, True])
def test_activation_recompute_gives_the_gradients_of_a_plain_backward(moe_dir: Path, replay: bool) -> None:
    """`trainer.gradient_checkpointing` recomputes each block in backward: the router must
    save the same tensors then as in the forward (torch checks and raises otherwise), and the
    gradients, the load-balancing loss included, are those of a backward without recompute."""
    ids = torch.randint(0, 259, (1, 12))
    forced = torch.randint(0, 8, (12, 2, 2))

    def grads(recompute: bool) -> dict[str, torch.Tensor]:
        model = _load(moe_dir).train()
        if recompute:
            model.gradient_checkpointing_enable()
        routing = MoeRouting(model)
        with routing.micro_batch(forced, torch.ones(12), replay=replay) as stats:
            out = model(input_ids=ids, labels=ids)
            (out.loss + 0.1 * routing.stats().aux_loss).backward()
        assert float(stats[0].aux_loss.detach()) > 0
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, recomputed = grads(False), grads(True)
    assert any("gate.weight" in n for n in plain) and plain.keys() == recomputed.keys()
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)
