"""The rollout's MoE routing on its way to the trainer: exact through the wire (compact
dtypes, zero-copy frames), across the turns of an episode, into packed training batches, a
controller checkpoint, mini-batches and micro-batches (packed and padded), row for row."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from roles.controller.batching import build_train_batches, pack_routed_experts
from roles.controller.dataset import Prompt
from roles.controller.groups import Group, SampleRec
from roles.controller.state import GroupState, group_state, restore_group
from roles.generation.engine import Sample
from roles.rollout.completion import routing_tensor
from roles.rollout.episode import Trajectory
from roles.training.microbatch import pack_micro_batches, split_micro_batches
from roles.training.minibatch import select_sequences
from tests.unit.transport.test_codec import roundtrip
from transport import wire
from transport.codec import Encoder

LAYERS, TOP_K = 3, 2


def routing(rows: int, seed: int, experts: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, experts, size=(rows, LAYERS, TOP_K))


# Frames read back as bytes are read-only, as zmq's are: torch warns once per process (test_codec's mark).
@pytest.mark.filterwarnings("ignore:The given buffer is not writable")
def test_routing_survives_the_wire_exactly_in_a_small_dtype() -> None:
    small, wide = routing_tensor(routing(40, 0)), routing_tensor(routing(40, 1, experts=300))
    assert small is not None and wide is not None
    assert (small.dtype, wide.dtype) == (torch.uint8, torch.int16)
    for t in (small, wide):
        msg = wire.Completion(
            request_id="r",
            group_id=1,
            sample_index=0,
            token_ids=torch.arange(30),
            logprobs=torch.zeros(30),
            versions=torch.zeros(30, dtype=torch.int32),
            finish_reason=wire.FinishReason.STOP,
            routed_experts=t,
        )
        got = roundtrip(msg)
        assert got.routed_experts.dtype == t.dtype and torch.equal(got.routed_experts, t)
    # It travels as a frame of its own (zero-copy), the same bytes as the tensor.
    frames = Encoder(256).encode(msg)
    assert any(bytes(memoryview(f)) == wide.numpy().tobytes() for f in frames[1:])


def _turn(tokens: int, routed: np.ndarray | None) -> Sample:
    s = Sample(list(range(tokens)), [0.0] * tokens, [0] * tokens, wire.FinishReason.STOP, 0, 0.0)
    s.routed_experts = routed
    return s


def test_an_episode_keeps_each_rows_routing_from_the_turn_that_computed_it() -> None:
    full = routing(30, 2)
    t = Trajectory()
    t.sampled(_turn(5, full[:9]))  # prompt 4 + 5 sampled: rows 0..8 (the last token not yet fed)
    t.num_turns += 1
    t.observed([1, 2, 3])
    second = full[:16].copy()
    second[:9] = 99  # a later turn's view of earlier rows is not the one that sampled them
    t.sampled(_turn(4, second))  # context 4 + 5 + 3, then 4 sampled: rows up to 15
    t.num_turns += 1
    assert np.array_equal(t.routed_experts, full[:16])


def test_an_episode_stops_at_the_first_turn_without_a_report() -> None:
    t = Trajectory()
    t.sampled(_turn(3, None))
    t.num_turns += 1
    t.sampled(_turn(3, routing(9, 3)))
    assert t.routed_experts is None


def _group(gid: int, prompt: list[int], samples: list[SampleRec]) -> Group:
    g = Group(
        gid=gid,
        prompt=Prompt(uid=gid, row=gid, prompt_ids=prompt, text=""),
        n=len(samples),
        request_id="r",
        admitted_version=0,
    )
    for s in samples:
        g.samples[s.index] = s
    return g


def _rec(index: int, length: int, routed: torch.Tensor | None) -> SampleRec:
    return SampleRec(
        index=index,
        token_ids=torch.arange(length),
        logprobs=torch.zeros(length),
        versions=torch.zeros(length, dtype=torch.int32),
        finish_reason=wire.FinishReason.STOP,
        reward=float(index),
        routed_experts=routed,
    )


def _groups() -> list[Group]:
    r = [routing_tensor(routing(n, 10 + i)) for i, n in enumerate((6, 8, 4))]
    return [
        _group(0, [7, 8, 9], [_rec(0, 4, r[0]), _rec(1, 6, r[1])]),  # reported rows: 6 of 7, 8 of 9
        _group(1, [5, 6], [_rec(0, 3, None), _rec(1, 5, r[2])]),  # no report; 4 of 7
    ]


def test_training_batches_carry_each_tokens_routing_and_a_mask_of_the_reported_rows() -> None:
    groups = _groups()
    (batch,), _ = build_train_batches(groups, step=1, advantage="grpo", norm_by_std=True, num_shards=1)
    assert batch.routed_experts is not None and batch.routed_mask is not None
    assert batch.routed_experts.shape == (batch.input_ids.numel(), LAYERS, TOP_K)
    assert batch.routed_experts.dtype == torch.uint8
    assert batch.routed_mask.tolist() == [1] * 6 + [0] + [1] * 8 + [0] + [0] * 5 + [1] * 4 + [0] * 3
    cu = batch.cu_seqlens.tolist()
    for i, s in enumerate([s for g in groups for s in g.ordered()]):
        if s.routed_experts is not None:
            n = s.routed_experts.shape[0]
            assert torch.equal(batch.routed_experts[cu[i] : cu[i] + n], s.routed_experts)
    assert pack_routed_experts([(g, s) for g in groups[1:] for s in g.ordered()][:1]) is None


def test_a_checkpointed_group_restores_its_routing_exactly() -> None:
    g = _groups()[0]
    saved = msgspec.json.encode(group_state(g))  # as the checkpoint's JSON holds it
    assert b'"routed_dtype":"uint8"' in saved and b'"routed_experts":[' not in saved  # bytes (base64), not lists
    back = restore_group(msgspec.json.decode(saved, type=GroupState))
    for s in g.ordered():
        got = back.samples[s.index].routed_experts
        assert got is not None and got.dtype == s.routed_experts.dtype and torch.equal(got, s.routed_experts)


def test_micro_batches_hold_the_routing_of_the_rows_the_model_sees() -> None:
    (batch,), _ = build_train_batches(_groups(), step=1, advantage="grpo", norm_by_std=True, num_shards=1)
    assert batch.routed_experts is not None and batch.routed_mask is not None
    mini = select_sequences(batch, [3, 0])
    cu = batch.cu_seqlens.tolist()
    want = torch.cat([batch.routed_experts[cu[3] : cu[4]], batch.routed_experts[cu[0] : cu[1]]])
    assert mini.routed_experts is not None and torch.equal(mini.routed_experts, want)
    for mb in pack_micro_batches(batch, budget=64):  # one row, sequences back to back
        assert mb.routing is not None and mb.packed is not None
        rows = torch.cat([batch.routed_experts[s:e] for s, e in mb.spans])
        assert torch.equal(mb.routing[0], rows) and mb.routing[0].shape[0] == mb.packed.input_ids_1P.shape[1]
    for mb in split_micro_batches(batch, budget=64):  # [B, T] flattened; padding masked
        assert mb.routing is not None
        experts, mask = mb.routing
        B, T = mb.input_ids_BT.shape
        assert experts.shape[0] == B * T and mask.shape[0] == B * T
        for row, (s, e) in enumerate(mb.spans):
            assert torch.equal(experts[row * T : row * T + e - s], batch.routed_experts[s:e])
            assert mask[row * T + e - s : (row + 1) * T].sum() == 0
