"""The controller's part of a checkpoint, as JSON (msgspec): the ledger (step, gate
counters, totals, the samples accepted but not trained yet, and the prompts that were in
flight, generated again on resume so no prompt is skipped), the dataset cursor and the
adaptive KL coefficient."""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from roles.controller.dataset import Prompt
from roles.controller.groups import Group, SampleRec
from transport.wire import FinishReason

_TENSORS = ("values", "advantages", "returns", "token_rewards", "ref_logprobs", "teacher_logprobs")


class PromptState(msgspec.Struct):
    uid: int
    row: int
    prompt_ids: list[int]
    text: str
    answer: Any = None
    metadata: dict[str, Any] = {}


class SampleState(msgspec.Struct):
    index: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: int
    reward: float | None = None
    tensors: dict[str, list[float]] = {}
    reward_error: str = ""
    loss_mask: list[int] | None = None  # multi-turn: 0 on environment tokens
    num_turns: int = 0
    # MoE routing replay: the [N, layers, top_k] indices as raw bytes (base64 in the JSON) in
    # `routed_dtype` ("uint8" | "int16"), `routed_shape` their shape: 1 or 2 bytes an index, not a
    # JSON list (a 48-layer top-8 model has 384 of them a token).
    routed_experts: bytes | None = None
    routed_shape: list[int] = []
    routed_dtype: str = ""


class GroupState(msgspec.Struct):
    gid: int
    prompt: PromptState
    n: int
    admitted_version: int
    samples: list[SampleState] = []
    value_version: int | None = None


class LedgerState(msgspec.Struct):
    """The ledger's part (taken between steps: no batch is in training)."""

    step: int
    next_gid: int
    gate: dict[str, int]
    totals: dict[str, int]
    ready: list[GroupState]
    pending: list[GroupState]  # in flight or waiting for re-dispatch: prompts only


class ControllerState(msgspec.Struct):
    ledger: LedgerState
    dataset: dict[str, int]
    kl_coef: float = 0.0


def group_state(g: Group, with_samples: bool = True) -> GroupState:
    p = g.prompt
    prompt = PromptState(p.uid, p.row, list(p.prompt_ids), p.text, p.answer, dict(p.metadata))
    samples = [_sample_state(s) for s in g.ordered()] if with_samples else []
    return GroupState(g.gid, prompt, g.n, g.admitted_version, samples, g.value_version)


def _sample_state(s: SampleRec) -> SampleState:
    tensors = {k: getattr(s, k).tolist() for k in _TENSORS if getattr(s, k) is not None}
    return SampleState(
        s.index,
        s.token_ids.tolist(),
        s.logprobs.tolist(),
        s.versions.tolist(),
        int(s.finish_reason),
        s.reward,
        tensors,
        s.reward_error,
        None if s.loss_mask is None else s.loss_mask.tolist(),
        s.num_turns,
        *_routing_state(s.routed_experts),
    )


def restore_group(gs: GroupState) -> Group:
    p = gs.prompt
    prompt = Prompt(uid=p.uid, row=p.row, prompt_ids=p.prompt_ids, text=p.text, answer=p.answer, metadata=p.metadata)
    group = Group(gid=gs.gid, prompt=prompt, n=gs.n, request_id=f"g{gs.gid}r", admitted_version=gs.admitted_version)
    group.value_version = gs.value_version
    for ss in gs.samples:
        rec = SampleRec(
            index=ss.index,
            token_ids=torch.tensor(ss.token_ids, dtype=torch.int64),
            logprobs=torch.tensor(ss.logprobs, dtype=torch.float32),
            versions=torch.tensor(ss.versions, dtype=torch.int32),
            finish_reason=FinishReason(ss.finish_reason),
            reward=ss.reward,
            reward_error=ss.reward_error,
            loss_mask=None if ss.loss_mask is None else torch.tensor(ss.loss_mask, dtype=torch.uint8),
            num_turns=ss.num_turns,
            routed_experts=_routing_tensor(ss),
        )
        for k, v in ss.tensors.items():
            setattr(rec, k, torch.tensor(v, dtype=torch.float32))
        group.samples[ss.index] = rec
    return group


def _routing_state(routed: torch.Tensor | None) -> tuple[bytes | None, list[int], str]:
    """(bytes, shape, dtype name) of a sample's routed experts, as `SampleState` keeps them."""
    if routed is None:
        return None, [], ""
    t = routed.contiguous()
    return t.numpy().tobytes(), list(t.shape), str(t.dtype).removeprefix("torch.")


def _routing_tensor(ss: SampleState) -> torch.Tensor | None:
    """The saved routing, exactly as it was sent (dtype and shape)."""
    if ss.routed_experts is None:
        return None
    dtype = getattr(torch, ss.routed_dtype)
    return torch.frombuffer(bytearray(ss.routed_experts), dtype=dtype).reshape(ss.routed_shape).clone()


def encode(state: ControllerState) -> bytes:
    return msgspec.json.encode(state)


def decode(data: bytes) -> ControllerState:
    return msgspec.json.decode(data, type=ControllerState)
