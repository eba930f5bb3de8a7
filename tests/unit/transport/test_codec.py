"""Codec: round trips over every dtype and shape, zero copy both ways, frame counts, every refusal."""

from __future__ import annotations

import gc
import math
import pickle
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transport import wire
from transport.codec import CODE_DTYPES, DTYPE_CODES, Decoder, Encoder, WireError, frames_nbytes
from transport.wire import SCHEMA_VERSION, Header, MsgType

pytestmark = [
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental"),
]

ALL_DTYPES = sorted(DTYPE_CODES, key=DTYPE_CODES.__getitem__)
FLOATS = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
COMPLEX = {torch.complex64, torch.complex128, torch.complex32}
INTS = {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8}
FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple)


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random data of any wire dtype; floats carry NaN and inf, the rest are raw bytes."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype in FLOATS:
        t = torch.randn(n, generator=g).to(dtype)
        t[::5] = float("nan")
        t[1::7] = float("inf")
    elif dtype in COMPLEX:
        t = torch.randn(n, dtype=torch.complex64, generator=g).to(dtype)
    elif dtype in INTS:
        info = torch.iinfo(dtype)
        t = torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(dtype)
    elif dtype is torch.bool:
        t = torch.randint(0, 2, (n,), generator=g).bool()
    else:  # float8 / float4 / wide unsigned: no random generator, reinterpret bytes
        t = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8).view(dtype)
    return t.reshape(shape)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor in C order, so NaNs compare equal and every dtype compares."""
    t = t.contiguous()
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert torch.equal(raw_bytes(got), raw_bytes(want))


def to_wire(frames: list[Any]) -> list[bytes]:
    """What a receiver gets: every frame as its own bytes object (nothing shared with the sender)."""
    return [f if isinstance(f, bytes) else np.asarray(f).tobytes() for f in frames]


def bucket(tensors: dict[str, torch.Tensor], version: int = 0) -> wire.WeightBucket:
    """A weight bucket of `tensors`: the message that carries named tensors of any dtype."""
    return wire.WeightBucket(version=version, index=0, last=True, tensors=tensors)


def peer(**capabilities: Any) -> wire.Register:
    """A `Register` whose free-form `capabilities` hold the given values."""
    return wire.Register(peer=wire.PeerInfo(role="test", rank=0, capabilities=capabilities))


def roundtrip(msg: wire.Message, *, threshold: int = 256, corr: int = 0, flags: int = 0) -> Any:
    header, out = Decoder().decode(to_wire(Encoder(threshold).encode(msg, corr=corr, flags=flags)))
    assert (header.schema, header.type, header.corr, header.flags) == (SCHEMA_VERSION, wire.type_code(msg), corr, flags)
    return out


def reason(frames: list[Any]) -> str:
    with pytest.raises(WireError) as info:
        Decoder().decode(frames)
    return info.value.reason


# --- round trips ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@FUZZ
@given(shape=shapes, seed=st.integers(0, 2**16), threshold=st.sampled_from([0, 16, 256]))
def test_every_dtype_and_shape_round_trips(
    dtype: torch.dtype, shape: tuple[int, ...], seed: int, threshold: int
) -> None:
    t = make_tensor(dtype, shape, seed)
    out = roundtrip(bucket({"t": t}, version=seed), threshold=threshold)
    assert out.version == seed
    assert_same(out.tensors["t"], t)


def _noncontiguous(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "transpose":
        return t.transpose(0, -1)
    if how == "step":
        return t[::2]
    if how == "permute":
        return t.permute(*reversed(range(t.dim())))
    if how == "expand":
        return t[:1].expand(3, *t.shape[1:])
    if how == "single":  # one element, odd strides: "contiguous" to torch, not to view()
        return t[1:, -1:]
    return t[1:, ::3]  # "slice": offset and stride at once


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@FUZZ
@given(
    shape=st.lists(st.integers(2, 9), min_size=2, max_size=4).map(tuple),
    how=st.sampled_from(["transpose", "step", "permute", "expand", "slice", "single"]),
    seed=st.integers(0, 2**16),
)
def test_noncontiguous_tensors_round_trip(dtype: torch.dtype, shape: tuple[int, ...], how: str, seed: int) -> None:
    view = _noncontiguous(make_tensor(dtype, shape, seed), how)
    out = roundtrip(bucket({"v": view}), threshold=16)
    assert_same(out.tensors["v"], view)


def test_zero_dim_and_empty_tensors_round_trip() -> None:
    tensors = {
        "scalar": torch.tensor(3.5),
        "scalar_bf16": torch.tensor(-1.25, dtype=torch.bfloat16),
        "empty": torch.empty(0),
        "empty_2d": torch.empty(3, 0, dtype=torch.int64),
        "empty_4d": torch.empty(2, 0, 4, 1, dtype=torch.float8_e5m2),
    }
    out = roundtrip(bucket(tensors), threshold=0)
    for name, t in tensors.items():
        assert_same(out.tensors[name], t)


def test_views_with_flags_and_grad_round_trip() -> None:
    """Conjugate/negative views and tensors that need grad travel as their values."""
    c = torch.randn(300, dtype=torch.complex64)
    x = torch.randn(300, requires_grad=True)
    tensors = {"conj": c.conj(), "neg": torch._neg_view(x.detach()), "grad": x * 2}
    out = roundtrip(bucket(tensors))
    assert torch.equal(out.tensors["conj"], c.conj().resolve_conj())
    assert torch.equal(out.tensors["neg"], -x.detach())
    assert torch.equal(out.tensors["grad"], (x * 2).detach())
    assert not out.tensors["grad"].requires_grad


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_single_element_views_with_odd_strides_round_trip(dtype: torch.dtype) -> None:
    """A [1, 1] slice is contiguous to torch whatever its strides; the codec must not trip on them."""
    base = make_tensor(dtype, (3, 400), seed=1)
    views = {"col": base[1:2, 5:6], "corner": base[2:, ::400], "t": base[:, 7:8].T[:, :1]}
    for threshold in (0, 256):
        out = roundtrip(bucket(views), threshold=threshold)
        for name, view in views.items():
            assert_same(out.tensors[name], view)


def test_schema_messages_with_tensors_round_trip() -> None:
    completion = wire.Completion(
        request_id="r1",
        group_id=3,
        sample_index=1,
        token_ids=torch.arange(100),
        logprobs=torch.randn(100),
        versions=torch.full((100,), 7, dtype=torch.int32),
        finish_reason=wire.FinishReason.STOP,
    )
    batch = wire.TrainBatch(
        step=2,
        input_ids=torch.arange(64),
        cu_seqlens=torch.tensor([0, 30, 64], dtype=torch.int32),
        loss_mask=torch.ones(64, dtype=torch.bool),
        behaviour_logprobs=torch.randn(64),
        advantages=torch.randn(64),
        global_num_tokens=64,
        global_num_seqs=2,
        returns=torch.randn(64),
    )
    multiturn = msgspec.structs.replace(
        completion,
        loss_mask=(torch.arange(100) % 3 != 0).to(torch.uint8),
        env_reward=0.5,
        num_turns=3,
    )
    bucket = wire.WeightBucket(version=4, index=0, last=True, tensors={"w": torch.randn(32, 16, dtype=torch.bfloat16)})
    for msg in (completion, multiturn, batch, bucket):
        out = roundtrip(msg)
        assert type(out) is type(msg)
        for field in msg.__struct_fields__:
            want, got = getattr(msg, field), getattr(out, field)
            if isinstance(want, torch.Tensor):
                assert_same(got, want)
            elif isinstance(want, dict) and want and isinstance(next(iter(want.values())), torch.Tensor):
                for k in want:
                    assert_same(got[k], want[k])
            else:
                assert got == want
    assert roundtrip(batch).old_values is None
    single = roundtrip(completion)
    assert (single.loss_mask, single.env_reward, single.num_turns) == (None, None, 0)


def test_encoder_output_decodes_in_process_without_zmq() -> None:
    """Frames straight from the encoder (numpy views, no copy) are valid decoder input."""
    tensors = {str(dtype): make_tensor(dtype, (40, 3)) for dtype in ALL_DTYPES}
    _, out = Decoder().decode(Encoder(inline_threshold=0).encode(bucket(tensors)))
    for name, t in tensors.items():
        assert_same(out.tensors[name], t)


# --- frames and zero copy ------------------------------------------------------------


def test_large_tensors_get_one_frame_each_small_ones_none() -> None:
    enc = Encoder(inline_threshold=256)
    tensors = {
        "empty": torch.empty(0),
        "tiny": torch.zeros(4),
        "at_threshold": torch.zeros(64),  # 256 bytes: still inline
        "above": torch.zeros(65),
        "big": torch.zeros(10_000),
        "big_int": torch.zeros(300, dtype=torch.int64),
    }
    frames = enc.encode(bucket(tensors))
    assert len(frames) == 2 + 3
    assert sorted(f.nbytes for f in frames[2:]) == [260, 2400, 40_000]
    assert frames_nbytes(frames) == sum(len(np.asarray(f).reshape(-1).view(np.uint8)) for f in frames)
    assert len(enc.encode(wire.Heartbeat(sent_at=1.0))) == 2


def test_encode_frame_shares_memory_with_the_tensor() -> None:
    t = torch.randn(1000, 10)
    frames = Encoder().encode(bucket({"t": t}))
    assert frames[2].ctypes.data == t.data_ptr()
    sliced = torch.randn(100, 100)[10:20]  # contiguous with a storage offset: still no copy
    (frame,) = Encoder().encode(bucket({"s": sliced}))[2:]
    assert frame.ctypes.data == sliced.data_ptr()


def test_decoded_tensor_is_a_view_of_the_received_zmq_frame() -> None:
    ctx = zmq.Context()
    tx, rx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        tx.bind("inproc://codec-zero-copy")
        rx.connect("inproc://codec-zero-copy")
        t = torch.randn(256, 1024)
        tx.send_multipart(Encoder().encode(bucket({"t": t})), copy=False)
        frames = rx.recv_multipart(copy=False)
        _, out = Decoder().decode(frames)
        frame_t = np.frombuffer(frames[2].buffer, np.uint8).ctypes.data
        assert out.tensors["t"].untyped_storage().data_ptr() == frame_t
        assert out.tensors["t"].data_ptr() == frame_t
        assert torch.equal(out.tensors["t"], t)
        # The tensor keeps its frame alive: drop every other reference and read it again.
        decoded = out.tensors["t"]
        del frames, out
        gc.collect()
        assert torch.equal(decoded, t)
    finally:
        tx.close(0)
        rx.close(0)
        ctx.term()


def test_decoded_tensor_shares_the_frame_buffer() -> None:
    t = torch.arange(1000, dtype=torch.int32)
    frames = to_wire(Encoder().encode(bucket({"t": t})))
    frames[2] = bytearray(frames[2])
    _, out = Decoder().decode(frames)
    assert out.tensors["t"].data_ptr() == np.frombuffer(frames[2], np.uint8).ctypes.data
    frames[2][0:4] = (-7).to_bytes(4, "little", signed=True)
    assert out.tensors["t"][0] == -7


# --- pickle refused --------------------------------------------------------------------


class Opaque:
    pass


REFUSED = {
    "object": lambda: peer(obj=Opaque()),
    "lambda": lambda: peer(nested=[1, {"f": lambda: 0}]),
    "numpy-array": lambda: peer(a=np.zeros(3)),
    "object-array": lambda: peer(o=np.array([1, "a", None], dtype=object)),
    "sparse": lambda: bucket({"sparse": torch.eye(3).to_sparse()}),
    "quantized": lambda: bucket({"q": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)}),
}


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_non_schema_objects_are_refused_at_encode(case: str) -> None:
    enc = Encoder(inline_threshold=0)
    with pytest.raises(TypeError):
        enc.encode(REFUSED[case]())
    # The encoder is still usable and carries nothing over from the failed message.
    assert len(enc.encode(bucket({"t": torch.ones(10)}))) == 3


EXECUTED: list[str] = []


def _side_effect() -> None:
    EXECUTED.append("pickle ran")


class Evil:
    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_side_effect, ())


def test_pickle_bytes_are_never_unpickled() -> None:
    header = Header(SCHEMA_VERSION, MsgType.WEIGHT_BUCKET, 0, 0).pack()
    for payload in (pickle.dumps(Evil()), pickle.dumps({"seq": 1}), pickle.dumps(wire.Ack())):
        assert reason([header, payload]) == "malformed"
    # Pickle bytes inside a free-form field stay opaque bytes.
    evil = pickle.dumps(Evil())
    out = roundtrip(peer(p=evil))
    assert out.peer.capabilities["p"] == evil
    assert EXECUTED == []


# --- bad input ---------------------------------------------------------------------------


def good_frames(**tensors: torch.Tensor) -> list[bytes]:
    return to_wire(Encoder(inline_threshold=16).encode(bucket(tensors, version=1), corr=5))


def payload(tensors: Any) -> bytes:
    """A hand-made `WeightBucket` payload (version 1, index 0, last) with `tensors` as given."""
    return msgspec.msgpack.encode([int(MsgType.WEIGHT_BUCKET), 1, 0, True, tensors])


def header(schema: int = SCHEMA_VERSION, type_: int = MsgType.WEIGHT_BUCKET) -> bytes:
    return Header(schema, type_, 0, 0).pack()


@pytest.mark.parametrize("size", [0, 11, 13, 100])
def test_wrong_header_size(size: int) -> None:
    assert reason([b"\x01" * size, *good_frames()[1:]]) == "bad_header"


@pytest.mark.parametrize("schema", [0, SCHEMA_VERSION + 1, 255])
def test_wrong_schema_version(schema: int) -> None:
    assert reason([header(schema=schema), *good_frames()[1:]]) == "schema_version"


@pytest.mark.parametrize("code", [0, 9, 99, 255])
def test_unknown_type_code(code: int) -> None:
    assert code not in {int(t) for t in MsgType}
    assert reason([header(type_=code), *good_frames()[1:]]) == "unknown_type"


@pytest.mark.parametrize("garbage", [b"", b"\xc1", b"\xff\x00garbage", b"\x93\x01\x02", msgspec.msgpack.encode("hi")])
def test_garbage_payload(garbage: bytes) -> None:
    assert reason([header(), garbage]) == "malformed"


def test_header_type_not_matching_payload() -> None:
    frames = good_frames()
    assert reason([header(type_=MsgType.HEARTBEAT), *frames[1:]]) == "malformed"
    assert reason([header(type_=MsgType.WEIGHT_BUCKET), *to_wire(Encoder().encode(wire.Ack()))[1:]]) == "malformed"


def test_too_few_frames_is_truncated() -> None:
    assert reason([]) == "truncated"
    assert reason([header()]) == "truncated"


def test_reference_to_missing_frame_is_truncated() -> None:
    frames = good_frames(a=torch.zeros(100), b=torch.ones(100))
    assert len(frames) == 4
    assert reason(frames[:3]) == "truncated"
    assert reason(frames[:2]) == "truncated"
    assert reason([header(), payload({"t": [0, [4], 7]})]) == "truncated"


@pytest.mark.parametrize("delta", [-4, -1, 1, 4])
def test_frame_with_wrong_byte_count_is_malformed(delta: int) -> None:
    frames = good_frames(t=torch.zeros(100))
    data = frames[2][:delta] if delta < 0 else frames[2] + b"\0" * delta
    assert reason([*frames[:2], data]) == "malformed"


def test_inline_data_with_wrong_byte_count_is_malformed() -> None:
    assert reason([header(), payload({"t": [0, [4], b"\0" * 15]})]) == "malformed"


def test_extra_unreferenced_frames_are_malformed() -> None:
    frames = good_frames(t=torch.zeros(100))
    assert reason([*frames, b"\0" * 400]) == "malformed"
    assert reason([*good_frames(), b"extra"]) == "malformed"


@pytest.mark.parametrize(
    "ref",
    [
        [99, [4], b"\0" * 16],  # unknown dtype code
        [True, [2], b"\0" * 16],  # a bool is not a dtype code
        [0, [-1], b""],  # negative dimension
        [0, [True], b"\0" * 4],  # a bool is not a dimension
        [0, [0, 2**63], b""],  # zero elements, but a dimension torch cannot hold
        [0, [2**64 - 1, 0], b""],
        [0, 4, b"\0" * 16],  # shape not a list
        [0, [4]],  # not a triple
        "tensor",
        [0, [4], "0" * 16],  # data neither bytes nor a frame index
        [0, [4], -1],  # negative frame index
    ],
)
def test_bad_tensor_references_are_malformed(ref: Any) -> None:
    assert reason([header(), payload({"t": ref})]) == "malformed"


def test_code_tables_agree() -> None:
    assert len(DTYPE_CODES) == len(CODE_DTYPES) == len(set(DTYPE_CODES.values()))
    assert all(CODE_DTYPES[code] is dtype for dtype, code in DTYPE_CODES.items())


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_mutated_messages_only_ever_raise_wire_error(data: st.DataObject) -> None:
    """Flipping, cutting or appending bytes anywhere never escapes as another exception."""
    frames = good_frames(t=torch.arange(30, dtype=torch.float32), s=torch.tensor([1, 2]))
    frames = [bytearray(f) for f in frames]
    i = data.draw(st.integers(0, len(frames) - 1))
    op = data.draw(st.sampled_from(["flip", "cut", "append", "replace"]))
    f = frames[i]
    if op == "flip" and f:
        f[data.draw(st.integers(0, len(f) - 1))] ^= data.draw(st.integers(1, 255))
    elif op == "cut":
        del f[data.draw(st.integers(0, len(f))) :]
    elif op == "append":
        f += data.draw(st.binary(min_size=1, max_size=8))
    else:
        frames[i] = bytearray(data.draw(st.binary(max_size=64)))
    try:
        Decoder().decode(frames)
    except WireError as exc:
        assert exc.reason in {"bad_header", "schema_version", "unknown_type", "malformed", "truncated"}


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=200), aux=st.lists(st.binary(max_size=32), max_size=3))
def test_random_payloads_only_ever_raise_wire_error(body: bytes, aux: list[bytes]) -> None:
    for type_code in (MsgType.WEIGHT_BUCKET, MsgType.COMPLETION, MsgType.HEARTBEAT):
        try:
            Decoder().decode([header(type_=type_code), body, *aux])
        except WireError as exc:
            assert exc.reason in {"malformed", "truncated"}
