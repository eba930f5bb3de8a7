"""Message codec: msgpack payload plus one zero-copy frame per tensor.

`Encoder.encode` returns the frame list for `send_multipart(copy=False)`: the header,
the msgpack payload, then the raw bytes of every tensor larger than `inline_threshold`
(smaller ones ride inside the payload). The tensor frames are views
of the tensors' own memory, so a caller must not modify a tensor until it is sent.

`Decoder.decode` turns received frames back into a message. Tensors are built with
`torch.frombuffer` over the received frames (no copy), so they stay valid as long as
the tensor is alive and share memory with the frame. Pickle is never used: only the
types of the wire schema can be decoded, anything else is a `WireError`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from transport.wire import MESSAGE_TYPES, SCHEMA_VERSION, Header, Message, type_code

# Received frames are read-only; tensors over them may be read freely. Writing to such a
# tensor writes to the frame, which the receiver owns, so the warning carries no risk.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

_DTYPE_NAMES = (
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "complex32",
    "uint8", "int8", "int16", "int32", "int64", "bool", "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
)  # fmt: skip
# Code = position in _DTYPE_NAMES: stable across versions as long as names are appended.
DTYPE_CODES: dict[torch.dtype, int] = {
    getattr(torch, name): code for code, name in enumerate(_DTYPE_NAMES) if hasattr(torch, name)
}
CODE_DTYPES: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}
# Dtypes that `Tensor.numpy()` accepts (the others are sent through a uint8 view).
_NUMPY_DTYPES = frozenset(getattr(torch, name) for name in _DTYPE_NAMES[:16] if name not in ("bfloat16", "complex32"))


class WireError(ValueError):
    """A message that cannot be accepted; `reason` is a short machine-friendly class."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class Encoder:
    """Encodes schema messages into frames. Not thread-safe: one per sending task."""

    def __init__(self, inline_threshold: int = 256) -> None:
        self.inline_threshold = inline_threshold
        self._frames: list[Any] = []
        self._msgpack = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)

    def encode(self, msg: Message, *, corr: int = 0, flags: int = 0) -> list[Any]:
        """Frames for `msg`: [header, payload, *tensor buffers]."""
        self._frames = [b"", b""]
        try:
            payload = self._msgpack.encode(msg)
            frames = self._frames
        finally:
            self._frames = []
        frames[0] = Header(SCHEMA_VERSION, type_code(msg), flags, corr).pack()
        frames[1] = payload
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._encode_tensor(obj)
        raise TypeError(f"cannot encode {type(obj).__name__} on the wire (pickle is refused)")

    def _encode_tensor(self, tensor: torch.Tensor) -> list[Any]:
        code = DTYPE_CODES.get(tensor.dtype)
        if code is None:
            raise TypeError(f"tensor dtype {tensor.dtype} has no wire code")
        return [code, list(tensor.shape), self._buffer_ref(_tensor_bytes(tensor))]

    def _buffer_ref(self, raw: np.ndarray) -> Any:
        """Small buffers inline as bytes; large ones as the index of a new frame.

        `raw` is C-contiguous; a frame is a flat uint8 view of it (same memory), so any
        buffer consumer, zmq or an in-process `Decoder`, reads plain bytes.
        """
        if raw.nbytes <= self.inline_threshold:
            return raw.tobytes()
        self._frames.append(raw.reshape(-1).view(np.uint8))
        return len(self._frames) - 3


class Decoder:
    """Decodes frames into schema messages. Not thread-safe: one per receiving task."""

    def __init__(self) -> None:
        self._aux: Sequence[Any] = ()
        self._used: set[int] = set()
        self._missing = False  # set when a reference names a frame that did not arrive
        self._msgpack = msgspec.msgpack.Decoder(Message, dec_hook=self._dec_hook)

    def decode(self, frames: Sequence[Any]) -> tuple[Header, Message]:
        """Header and message of `frames`; raises `WireError` on anything unacceptable."""
        header = self.header(frames)
        self._aux = [as_buffer(f) for f in frames[2:]] if len(frames) > 2 else ()
        self._used = set()
        self._missing = False
        try:
            msg = self._msgpack.decode(as_buffer(frames[1]))
        except Exception as exc:
            # A dec_hook error other than TypeError/ValueError (torch, numpy) propagates
            # out of msgspec unwrapped: it is bad input too, never a reason to crash.
            reason = "truncated" if self._missing else "malformed"
            raise WireError(reason, f"{type(exc).__name__}: {exc}"[:1000]) from None
        finally:
            aux, self._aux = self._aux, ()
        if type_code(msg) != header.type:
            raise WireError("malformed", f"header says type {header.type}, payload is {type(msg).__name__}")
        if len(self._used) != len(aux):
            raise WireError("malformed", f"{len(aux)} tensor frames, {len(self._used)} referenced")
        return header, msg

    @staticmethod
    def header(frames: Sequence[Any]) -> Header:
        """Check frame count, header, schema version and type code without decoding."""
        if len(frames) < 2:
            raise WireError("truncated", f"{len(frames)} frame(s), need header and payload")
        try:
            header = Header.unpack(as_buffer(frames[0]))
        except ValueError as exc:
            raise WireError("bad_header", str(exc)) from None
        if header.schema != SCHEMA_VERSION:
            raise WireError("schema_version", f"schema {header.schema}, expected {SCHEMA_VERSION}")
        if header.type not in MESSAGE_TYPES:
            raise WireError("unknown_type", f"type code {header.type}")
        return header

    def _dec_hook(self, typ: type, obj: Any) -> Any:
        if typ is torch.Tensor:
            return self._decode_tensor(obj)
        raise TypeError(f"unsupported type {typ}")

    def _decode_tensor(self, obj: Any) -> torch.Tensor:
        code, shape, ref = _triple(obj)
        dtype = CODE_DTYPES.get(code) if type(code) is int else None
        if dtype is None:
            raise ValueError(f"unknown dtype code {code!r}")
        buf = self._resolve(ref)
        nbytes = _numel(shape) * dtype.itemsize
        if len(buf) != nbytes:
            raise ValueError(f"tensor frame has {len(buf)} bytes, shape {shape} needs {nbytes}")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(buf, dtype=dtype)
        return flat if len(shape) == 1 else flat.view(shape)

    def _resolve(self, ref: Any) -> memoryview:
        if isinstance(ref, bytes):
            return memoryview(bytearray(ref))
        if type(ref) is not int:
            raise ValueError(f"tensor data must be bytes or a frame index, got {type(ref).__name__}")
        if ref < 0:
            raise ValueError(f"negative tensor frame index {ref}")
        if ref >= len(self._aux):
            self._missing = True
            raise ValueError(f"tensor frame {ref!r} missing: {len(self._aux)} frame(s) received")
        self._used.add(ref)
        return self._aux[ref]


def _tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a dense tensor's data in C order; no copy for a contiguous CPU tensor.

    The common case (a plain CPU tensor of a numpy dtype) costs two torch calls: small
    messages are latency-bound and each torch call costs microseconds when caches are cold.
    """
    if tensor.dtype in _NUMPY_DTYPES:
        try:
            return np.ascontiguousarray(tensor.numpy())
        except (RuntimeError, TypeError):
            pass  # needs grad, not on the CPU, sparse, or a conjugate/negative view
    if tensor.layout != torch.strided:
        raise TypeError(f"tensor layout {tensor.layout} cannot travel on the wire (dense tensors only)")
    # Conjugate and negative views keep their data un-negated behind a bit that a byte
    # view would lose; resolving is a no-op for other tensors.
    t = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
    if t.dtype in _NUMPY_DTYPES:
        return t.numpy()
    # Size-1 dims may carry any stride in a contiguous tensor, which `view(uint8)` refuses;
    # the elements are adjacent all the same, so a unit-stride flat view is exact.
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8).numpy()


def _triple(obj: Any) -> tuple[Any, list[int], Any]:
    if not isinstance(obj, list | tuple) or len(obj) != 3 or not isinstance(obj[1], list | tuple):
        raise ValueError("tensor reference must be [dtype, shape, data]")
    shape = list(obj[1])
    for d in shape:
        if type(d) is not int or d < 0:
            raise ValueError(f"bad shape {shape!r}")
    return obj[0], shape, obj[2]


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def as_buffer(frame: Any) -> memoryview:
    """A memoryview over a zmq.Frame (copy=False), bytes or any buffer, without copying."""
    buf = getattr(frame, "buffer", None)
    view = buf if buf is not None else memoryview(frame)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def frames_nbytes(frames: Sequence[Any]) -> int:
    """Total size of a frame list in bytes."""
    return sum(len(as_buffer(f)) for f in frames)
