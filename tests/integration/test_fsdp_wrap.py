"""FSDP2 wrapping on 2 gloo ranks: every strategy gives the unsharded model's loss and gradients.

One spawned run (2 processes) executes every case and writes each rank's verdicts to
JSON; the parametrised tests below read them, so a failure names its case and rank.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.tensor import DTensor

from roles.fsdp.wrap import (
    clip_grad_norm_,
    find_blocks,
    finish_backward,
    full_state_dict_items,
    optimizer_param_groups,
    wrap_model_with_fsdp,
)
from runtime.config import FSDPConfig, MixedPrecisionConfig
from tests.helpers.ports import rendezvous_file

WORLD_SIZE = 2
MAX_GRAD_NORM = 0.1  # well below the batch's gradient norm (~1.5), so clipping scales
LR = 0.5  # plain SGD: the step moves each weight by LR * clipped gradient
FP32_TOL = {"atol": 1e-5, "rtol": 1e-4}
# bf16 compute against an fp32 reference: bf16 keeps 8 significant bits (~4e-3 relative);
# measured max abs grad error 1.3e-3, while a wrong loss scaling is off by ~8e-2.
BF16_TOL = {"atol": 3e-3, "rtol": 5e-2}
BF16 = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")

# case -> (FSDPConfig fields, tolerance)
CASES: dict[str, tuple[dict[str, Any], dict[str, float]]] = {
    "FULL_SHARD": ({"sharding_strategy": "FULL_SHARD"}, FP32_TOL),
    "SHARD_GRAD_OP": ({"sharding_strategy": "SHARD_GRAD_OP"}, FP32_TOL),
    "NO_SHARD": ({"sharding_strategy": "NO_SHARD"}, FP32_TOL),
    "HYBRID_SHARD-1": ({"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 1}, FP32_TOL),
    "HYBRID_SHARD-2": ({"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 2}, FP32_TOL),
    "HYBRID_SHARD-auto": ({"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 0}, FP32_TOL),
    "use_fsdp=false": ({"use_fsdp": False}, FP32_TOL),
    "ignored=model.norm": ({"ignored_modules": ["model.norm"]}, FP32_TOL),
    "ignored=layers.*.mlp": ({"ignored_modules": ["model.layers.*.mlp"]}, FP32_TOL),
    "prefetch=BACKWARD_POST": ({"backward_prefetch": "BACKWARD_POST"}, FP32_TOL),
    "prefetch=none": ({"backward_prefetch": "none"}, FP32_TOL),
    "bf16-params/fp32-reduce": ({"mixed_precision": BF16}, BF16_TOL),
}
STATE_DICT_CASES = ("FULL_SHARD", "HYBRID_SHARD-2", "use_fsdp=false", "ignored=model.norm")


def tiny_model() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).float()


def fixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """ids[4, 12] and labels with -100 padding; rank 0's half holds fewer tokens than rank 1's."""
    ids_BT = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    labels_BT = ids_BT.clone()
    labels_BT[0, 7:] = -100
    labels_BT[1, 4:] = -100
    return ids_BT, labels_BT


def token_loss_sum(model: torch.nn.Module, ids_BT: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    logits_BTV = model(input_ids=ids_BT).logits.float()
    return F.cross_entropy(
        logits_BTV[:, :-1].flatten(0, 1), labels_BT[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )


def num_tokens(labels_BT: torch.Tensor) -> int:
    return int((labels_BT[:, 1:] != -100).sum())


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@contextmanager
def count_real_backward_prefetches() -> Iterator[list[int]]:
    """Counts prefetches that start an all-gather (not ones whose target is already gathered).

    Spies on a private FSDP2 method (torch 2.13): prefetching has no public observable.
    """
    original = FSDPParamGroup._prefetch_unshard
    counter = [0]

    def spy(target: FSDPParamGroup, pass_type: str) -> None:
        if pass_type == "backward" and not target.is_unsharded and target._all_gather_result is None:
            counter[0] += 1
        original(target, pass_type)

    FSDPParamGroup._prefetch_unshard = staticmethod(spy)
    try:
        yield counter
    finally:
        FSDPParamGroup._prefetch_unshard = staticmethod(original)


def run_case(pristine: torch.nn.Module, fields: dict[str, Any], tol: dict[str, float], ref: dict) -> dict:
    """One training step on this rank's half of the batch; "" or the first mismatch with `ref`."""
    model = wrap_model_with_fsdp(copy.deepcopy(pristine), FSDPConfig(**fields), device=torch.device("cpu"))
    return train_step(model, tol, ref)


def train_step(model: torch.nn.Module, tol: dict[str, float], ref: dict) -> dict:
    rank = dist.get_rank()
    ids_BT, labels_BT = fixed_batch()
    rows = slice(2 * rank, 2 * rank + 2)
    # The scaling rule of roles/fsdp/wrap.py: local sum / global count, times world size.
    loss = token_loss_sum(model, ids_BT[rows], labels_BT[rows]) / num_tokens(labels_BT)
    with count_real_backward_prefetches() as prefetches:
        (loss * WORLD_SIZE).backward()
    finish_backward(model)
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    got = {
        "loss": global_loss,
        "grads": {name: full(param.grad).clone() for name, param in model.named_parameters()},
        "norm": clip_grad_norm_(model, MAX_GRAD_NORM),
    }
    # foreach=True: the optimizer must not see DTensors and plain tensors in one list.
    torch.optim.SGD(optimizer_param_groups(model), lr=LR, foreach=True).step()
    got["params"] = {name: full(param.detach()).clone() for name, param in model.named_parameters()}
    return {"error": mismatch(got, ref, tol), "real_backward_prefetches": prefetches[0]}


def mismatch(got: dict, ref: dict, tol: dict[str, float]) -> str:
    try:
        for key in ("loss", "norm"):
            torch.testing.assert_close(got[key], ref[key], **tol, msg=lambda m, k=key: f"{k}: {m}")
        for key in ("grads", "params"):
            assert got[key].keys() == ref[key].keys(), f"{key} names {sorted(got[key])} != {sorted(ref[key])}"
            for name, tensor in got[key].items():
                torch.testing.assert_close(tensor, ref[key][name], **tol, msg=lambda m, k=key, n=name: f"{k} {n}: {m}")
    except AssertionError as exc:
        return str(exc)
    return ""


def guarded(check: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """The check's verdict, or its exception as the case's error (so one case cannot hide the rest)."""
    try:
        verdict = check(*args)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "real_backward_prefetches": -1}
    return verdict if isinstance(verdict, dict) else {"error": verdict}


def check_state_dict(pristine: torch.nn.Module, fields: dict[str, Any]) -> str:
    model = wrap_model_with_fsdp(copy.deepcopy(pristine), FSDPConfig(**fields), device=torch.device("cpu"))
    items = list(full_state_dict_items(model))
    expected = list(pristine.state_dict().items())
    if [n for n, _ in items] != [n for n, _ in expected]:
        return f"names {[n for n, _ in items]} != {[n for n, _ in expected]}"
    bad = [n for (n, t), (_, e) in zip(items, expected, strict=True) if isinstance(t, DTensor) or not torch.equal(t, e)]
    return f"tensors differ: {bad}" if bad else ""


def check_no_grad_forward_reshards(pristine: torch.nn.Module, fields: dict[str, Any], ref: dict) -> str:
    """A forward under no_grad leaves nothing gathered, and the next training step is unchanged."""
    model = wrap_model_with_fsdp(copy.deepcopy(pristine), FSDPConfig(**fields), device=torch.device("cpu"))
    with torch.no_grad():
        model(input_ids=fixed_batch()[0])
    gathered = [name for name, param in model.named_parameters() if not isinstance(param, DTensor)]
    if gathered:
        return f"gathered after a no_grad forward: {gathered}"
    return train_step(model, FP32_TOL, ref)["error"]


def expect_value_error(pristine: torch.nn.Module, fields: dict[str, Any]) -> str:
    try:
        wrap_model_with_fsdp(copy.deepcopy(pristine), FSDPConfig(**fields), device=torch.device("cpu"))
    except ValueError as exc:
        return str(exc)
    return "no error"


def reference(pristine: torch.nn.Module) -> dict:
    """The same step on one process, unsharded, over the whole batch."""
    model = copy.deepcopy(pristine)
    ids_BT, labels_BT = fixed_batch()
    loss = token_loss_sum(model, ids_BT, labels_BT) / num_tokens(labels_BT)
    loss.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    assert norm > 2 * MAX_GRAD_NORM
    torch.optim.SGD(model.parameters(), lr=LR).step()
    params = {name: param.detach().clone() for name, param in model.named_parameters()}
    return {"loss": loss.detach(), "grads": grads, "norm": norm, "params": params}


def worker(rank: int, rendezvous: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    dist.init_process_group(
        "gloo",
        init_method=rendezvous,
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=60),
    )
    try:
        pristine = tiny_model()
        ref = reference(pristine)
        results: dict[str, Any] = {name: guarded(run_case, pristine, *case, ref) for name, case in CASES.items()}
        results["state_dict"] = {
            name: guarded(check_state_dict, pristine, CASES[name][0])["error"] for name in STATE_DICT_CASES
        }
        results["no_grad"] = {
            name: guarded(check_no_grad_forward_reshards, pristine, CASES[name][0], ref)["error"]
            for name in ("FULL_SHARD", "SHARD_GRAD_OP")
        }
        results["hybrid_shard_size=3"] = expect_value_error(
            pristine, {"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 3}
        )
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's verdicts from one 2-process run of all cases."""
    out_dir = tmp_path_factory.mktemp("fsdp_wrap")
    mp.spawn(worker, args=(rendezvous_file(out_dir), str(out_dir)), nprocs=WORLD_SIZE, join=True)
    return [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]


@pytest.mark.parametrize("case", list(CASES))
def test_training_step_matches_unsharded_reference(spawned: list[dict[str, Any]], case: str) -> None:
    for rank, results in enumerate(spawned):
        assert results[case]["error"] == "", f"rank {rank}: {results[case]['error']}"


@pytest.mark.parametrize(
    ("case", "prefetches"), [("FULL_SHARD", True), ("prefetch=BACKWARD_POST", True), ("prefetch=none", False)]
)
def test_backward_prefetch_setting_is_honoured(spawned: list[dict[str, Any]], case: str, prefetches: bool) -> None:
    for results in spawned:
        assert (results[case]["real_backward_prefetches"] > 0) == prefetches


@pytest.mark.parametrize("case", STATE_DICT_CASES)
def test_full_state_dict_items_equal_unsharded_state_dict(spawned: list[dict[str, Any]], case: str) -> None:
    for rank, results in enumerate(spawned):
        assert results["state_dict"][case] == "", f"rank {rank}: {results['state_dict'][case]}"


@pytest.mark.parametrize("case", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_no_grad_forward_leaves_nothing_gathered(spawned: list[dict[str, Any]], case: str) -> None:
    for rank, results in enumerate(spawned):
        assert results["no_grad"][case] == "", f"rank {rank}: {results['no_grad'][case]}"


def test_hybrid_shard_size_must_divide_world_size(spawned: list[dict[str, Any]]) -> None:
    for results in spawned:
        assert results["hybrid_shard_size=3"].startswith("fsdp.hybrid_shard_size=3 must divide")


def test_cpu_offload_without_accelerator_is_a_one_line_value_error() -> None:
    with pytest.raises(ValueError, match=r"^fsdp\.cpu_offload=true needs an accelerator: ") as info:
        wrap_model_with_fsdp(tiny_model(), FSDPConfig(cpu_offload=True), device=torch.device("cpu"))
    assert "\n" not in str(info.value)


def test_unmatched_ignored_pattern_is_named() -> None:
    with pytest.raises(ValueError, match=r"'model\.nope'"):
        wrap_model_with_fsdp(tiny_model(), FSDPConfig(ignored_modules=["model.nope"]), device=torch.device("cpu"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"use_fsdp": False, "mixed_precision": BF16}, r"^fsdp\.mixed_precision needs fsdp\.use_fsdp=true"),
        ({"ignored_modules": ["model.norm"], "mixed_precision": BF16}, r"^fsdp\.ignored_modules cannot be combined"),
    ],
)
def test_mixed_precision_conflicts_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        wrap_model_with_fsdp(tiny_model(), FSDPConfig(**fields), device=torch.device("cpu"))


def test_wrap_needs_initialised_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"torch\.distributed initialised"):
        wrap_model_with_fsdp(tiny_model(), FSDPConfig(), device=torch.device("cpu"))


def test_find_blocks_uses_no_split_modules_then_first_module_list() -> None:
    model = tiny_model()
    assert find_blocks(model) == list(model.model.layers)
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList([torch.nn.Linear(2, 2)] * 3))
    assert find_blocks(plain) == list(plain[1])
