"""One peer of transport.zmtp_router's ROUTER: the ZMTP greeting and handshake, then
frames read into messages, each checked against the router's cap before its body is read.

What a caller (the router) may rely on: a connection hands the router only whole messages of
a peer that passed the handshake; a message whose declared frames would exceed
`router.max_message_bytes` (FRAME_OVERHEAD_BYTES counted for every frame past FREE_FRAMES)
closes the connection at once and is reported to `router.on_oversized`; refused handshakes
are logged and counted (`transport.security.note_refused`); `write_message` writes a message
whole, never interleaved with another.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol, cast

import zmq

from transport import zmtp
from transport.codec import as_buffer
from transport.security import note_refused
from transport.throttle import Throttled

FRAME_OVERHEAD_BYTES = 1024  # over-estimates what a received frame's objects cost
FREE_FRAMES = 64  # frames a message may have before their overhead counts
DIRECT_MIN_BYTES = 16 << 10  # a body with this much left is read straight into its buffer
WRITE_HIGH_BYTES = 16 << 20
BATCH_BYTES = 16 << 10  # frames smaller than this are joined into one write
TOKEN_REFUSED = "wrong or missing run token"

_GREETING, _FLAGS, _SIZE, _BODY = range(4)


class Router(Protocol):
    """What a connection asks of its router (transport.zmtp_router.ZmtpRouter)."""

    name: str
    mechanism: bytes
    max_message_bytes: int
    linger_s: float
    stage: memoryview  # the read buffer shared by the router's connections
    noisy: Throttled
    loop: asyncio.AbstractEventLoop

    def on_oversized(self, peer: bytes | None, detail: str) -> None: ...
    def password_ok(self, password: bytes) -> bool: ...
    def anonymous_identity(self) -> bytes: ...
    def register(self, conn: Connection, identity: bytes) -> bool: ...
    def lost(self, conn: Connection) -> None: ...
    def deliver(self, conn: Connection, message: list[Any]) -> None: ...


class Connection(asyncio.BufferedProtocol):
    """One peer: the greeting, the handshake, then frames into messages for `router`."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.transport: asyncio.Transport | None = None
        self.identity: bytes | None = None
        self.ready = False
        self._head = bytearray()
        self._need, self._state, self._flags = zmtp.GREETING_BYTES, _GREETING, 0
        self._body: memoryview = memoryview(b"")
        self._filled = 0
        self._parts: list[Any] = []
        self._declared = 0
        self._peer_frame: zmtp.Frame | None = None
        self._welcomed = False
        self._writable = True
        self._drained: list[asyncio.Future[None]] = []

    # --- asyncio callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream transport (uvloop's too)
        self.transport.set_write_buffer_limits(high=WRITE_HIGH_BYTES)
        self.transport.write(zmtp.greeting(self.router.mechanism))

    @property
    def _direct(self) -> bool:
        """Whether the next read goes straight into the frame body (else into the shared stage)."""
        return self._state == _BODY and len(self._body) - self._filled >= DIRECT_MIN_BYTES

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._body[self._filled :] if self._direct else self.router.stage

    def buffer_updated(self, nbytes: int) -> None:
        if self._direct:  # the same answer get_buffer had: nothing changed in between
            self._filled += nbytes
            if self._filled == len(self._body):
                self._frame_done()
            return
        self._feed(self.router.stage[:nbytes])

    def connection_lost(self, exc: Exception | None) -> None:
        self.router.lost(self)
        self._parts = []
        for waiter in self._drained:
            if not waiter.done():
                waiter.set_exception(zmq.ZMQError(zmq.EHOSTUNREACH))

    def pause_writing(self) -> None:
        self._writable = False

    def resume_writing(self) -> None:
        self._writable = True
        for waiter in self._drained:
            if not waiter.done():
                waiter.set_result(None)
        self._drained.clear()

    # --- reading --------------------------------------------------------------------------

    def _feed(self, data: memoryview) -> None:
        pos, end = 0, len(data)
        while pos < end and not self.closing:
            if self._state == _BODY:
                n = min(end - pos, len(self._body) - self._filled)
                self._body[self._filled : self._filled + n] = data[pos : pos + n]
                self._filled += n
                pos += n
                if self._filled == len(self._body):
                    self._frame_done()
                continue
            n = min(end - pos, self._need - len(self._head))
            self._head += data[pos : pos + n]
            pos += n
            if len(self._head) == self._need:
                self._header_done(bytes(self._head))

    def _header_done(self, head: bytes) -> None:
        self._head.clear()
        if self._state == _GREETING:
            self._on_greeting(head)
        elif self._state == _FLAGS:
            self._flags = head[0]
            self._state, self._need = _SIZE, 8 if head[0] & zmtp.LONG else 1
        else:
            self._begin_body(int.from_bytes(head, "big"))

    def _begin_body(self, size: int) -> None:
        if self._flags & zmtp.COMMAND:
            if size > zmtp.MAX_COMMAND_BYTES:
                return self._protocol_error(f"command of {size} bytes")
        elif not self.ready:
            return self._protocol_error("a message before the handshake")
        else:
            self._declared += size + FRAME_OVERHEAD_BYTES * (len(self._parts) >= FREE_FRAMES)
            if self._declared > self.router.max_message_bytes:
                return self._cut()
        self._state, self._filled = _BODY, 0
        self._body = memoryview(zmtp.new_body(size)).cast("B")
        if size == 0:
            self._frame_done()

    def _frame_done(self) -> None:
        body, self._body = self._body, memoryview(b"")
        self._state, self._need = _FLAGS, 1
        if self._flags & zmtp.COMMAND:
            self._on_command(body.tobytes())
            return
        self._parts.append(zmtp.Frame(body))
        if not self._flags & zmtp.MORE:
            parts, self._parts, self._declared = self._parts, [], 0
            assert self._peer_frame is not None
            self.router.deliver(self, [self._peer_frame, *parts])

    def _cut(self) -> None:
        """Close at once: nothing more of this message (or this peer) is read."""
        detail = (
            f"declared {self._declared} bytes in {len(self._parts) + 1} frames > max {self.router.max_message_bytes}"
        )
        self._parts, self._declared = [], 0
        self.abort()
        self.router.on_oversized(self.identity, detail)

    # --- handshake ------------------------------------------------------------------------

    def _on_greeting(self, head: bytes) -> None:
        if head[0] != 0xFF or not head[9] & 1 or head[10] < 3:
            return self._protocol_error("not a ZMTP 3 greeting")
        if head[12:32].rstrip(b"\x00") != self.router.mechanism:
            return self._refuse("handshake", "security mechanism mismatch (a peer without the run's token?)")
        self._state, self._need = _FLAGS, 1

    def _on_command(self, body: bytes) -> None:
        try:
            name, data = zmtp.parse_command(body)
            if name == b"PING":
                self._write(zmtp.command(b"PONG", data[2:]))
            elif name == b"HELLO" and self.router.mechanism == b"PLAIN" and not self.ready:
                self._on_hello(zmtp.parse_plain_hello(data))
            elif name in (b"READY", b"INITIATE") and not self.ready:
                self._on_ready(name, zmtp.parse_metadata(data))
        except (ValueError, IndexError) as exc:
            self._protocol_error(f"bad command: {exc}")

    def _on_hello(self, password: bytes) -> None:
        if not self.router.password_ok(password):
            self._write(zmtp.command(b"ERROR", bytes([len(TOKEN_REFUSED)]) + TOKEN_REFUSED.encode()))
            self._refuse("PLAIN", TOKEN_REFUSED, key="PLAIN")
            return
        self._welcomed = True
        self._write(zmtp.command(b"WELCOME"))

    def _on_ready(self, name: bytes, props: dict[str, bytes]) -> None:
        plain = self.router.mechanism == b"PLAIN"
        if (name == b"INITIATE") != plain or (plain and not self._welcomed):
            return self._protocol_error(f"unexpected {name.decode()}")
        identity = props.get("identity") or self.router.anonymous_identity()
        if not self.router.register(self, identity):
            return self._refuse("identity", "identity in use by a live peer")
        self.identity, self.ready = identity, True
        self._peer_frame = zmtp.Frame(memoryview(identity))
        self._write(zmtp.command(b"READY", zmtp.metadata({"Socket-Type": b"ROUTER"})))

    def _refuse(self, mechanism: str, reason: str, *, key: str = "") -> None:
        note_refused(mechanism, reason, key=key or f"{mechanism} {self.router.name}", channel=self.router.name)
        self.close(self.router.linger_s)

    def _protocol_error(self, reason: str) -> None:
        if self.ready:
            self.router.noisy.warning(
                "zmtp_protocol_error", key=self.router.name, channel=self.router.name, reason=reason
            )
            self.abort()
        else:
            self._refuse("handshake", f"handshake failed: {reason}")

    # --- writing and closing --------------------------------------------------------------

    @property
    def closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def _write(self, data: bytes) -> None:
        if not self.closing:
            assert self.transport is not None
            self.transport.write(data)

    def write_message(self, frames: Sequence[Any]) -> None:
        """Write one message whole; small frames go out in one write with their headers."""
        assert self.transport is not None
        batch = bytearray()
        last = len(frames) - 1
        for i, frame in enumerate(frames):
            view = as_buffer(frame)
            batch += zmtp.frame_header(zmtp.MORE if i < last else 0, len(view))
            if len(view) < BATCH_BYTES:
                batch += view
                continue
            self.transport.write(batch)
            self.transport.write(view)
            batch = bytearray()
        if batch:
            self.transport.write(batch)

    async def drained(self) -> None:
        """Until the write buffer is below its high-water mark (EHOSTUNREACH if lost)."""
        if self._writable:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._drained.append(waiter)
        await waiter

    @property
    def writable(self) -> bool:
        return self._writable and not self.closing

    def close(self, linger_s: float | None) -> None:
        """Close after pending writes, waiting for them `linger_s` at most (None: no bound)."""
        if self.transport is None:
            return
        if linger_s == 0:
            return self.abort()
        self.transport.close()
        if linger_s is not None:
            self.router.loop.call_later(linger_s, self.transport.abort)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
