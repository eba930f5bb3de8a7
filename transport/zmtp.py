"""ZMTP 3.0 wire pieces: greeting, frame headers, commands, metadata (RFC 23/ZMTP).

What a caller may rely on: these build and parse exactly what libzmq 4.3 sends and
expects; a parser raises ValueError (or IndexError) on input that is not well formed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SIGNATURE = b"\xff" + bytes(8) + b"\x7f"
GREETING_BYTES = 64
MORE, LONG, COMMAND = 0x01, 0x02, 0x04
MAX_COMMAND_BYTES = 64 << 10  # handshake commands are a few hundred bytes
READ_BYTES = 64 << 10  # small frames are parsed out of one read buffer this size


class Frame:
    """A received frame, shaped like the zmq.Frame the codec and endpoint read."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer

    @property
    def bytes(self) -> bytes:
        return self.buffer.tobytes()

    def __len__(self) -> int:
        return self.buffer.nbytes


def greeting(mechanism: bytes) -> bytes:
    """This server's greeting: ZMTP 3.0, `mechanism`, as-server."""
    return SIGNATURE + b"\x03\x00" + mechanism.ljust(20, b"\x00") + b"\x01" + bytes(31)


def command(name: bytes, data: bytes = b"") -> bytes:
    """One command frame, header included."""
    body = bytes([len(name)]) + name + data
    return frame_header(COMMAND, len(body)) + body


def frame_header(flags: int, size: int) -> bytes:
    if size > 255:
        return bytes([flags | LONG]) + size.to_bytes(8, "big")
    return bytes([flags, size])


def metadata(props: dict[str, bytes]) -> bytes:
    return b"".join(bytes([len(k)]) + k.encode() + len(v).to_bytes(4, "big") + v for k, v in props.items())


def parse_metadata(data: bytes) -> dict[str, bytes]:
    """Properties by lower-cased name; ValueError if `data` is not a property list."""
    props, pos = {}, 0
    while pos < len(data):
        end = pos + 1 + data[pos]
        name = data[pos + 1 : end].decode("ascii")
        size = int.from_bytes(data[end : end + 4], "big")
        pos = end + 4 + size
        if pos > len(data):
            raise ValueError("truncated metadata")
        props[name.lower()] = data[end + 4 : pos]
    return props


def parse_command(body: bytes) -> tuple[bytes, bytes]:
    size = body[0] if body else 0
    if not body or 1 + size > len(body):
        raise ValueError("bad command frame")
    return body[1 : 1 + size], body[1 + size :]


def parse_plain_hello(data: bytes) -> bytes:
    """The password of a PLAIN HELLO (username, password: each a length byte + bytes)."""
    user_end = 1 + data[0]
    size = data[user_end]
    if user_end + 1 + size != len(data):
        raise ValueError("bad HELLO")
    return data[user_end + 1 :]


def new_body(size: int) -> Any:
    # np.empty leaves a large body's pages untouched until the peer's bytes fill them.
    return bytearray(size) if size < READ_BYTES else np.empty(size, dtype=np.uint8)
