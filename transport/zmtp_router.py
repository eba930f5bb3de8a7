"""A ZMTP 3.0 ROUTER in asyncio that bounds a whole message, not just each frame.

Why it exists: libzmq caps each frame (ZMQ_MAXMSGSIZE) but hands over a multipart
message only once all its frames arrived, with no cap on their sum or number, so a peer
holding the run token could make a server buffer any number of frames under the cap.
This server reads each frame's declared size before its body and closes the connection
of a peer whose message would exceed `max_message_bytes` (counting FRAME_OVERHEAD_BYTES
for every frame past FREE_FRAMES, so a flood of empty frames is cut too).

What a caller may rely on (the subset of a zmq.asyncio ROUTER socket `RpcEndpoint` uses):

* Peers are unchanged libzmq DEALERs: NULL mechanism, or PLAIN with the run token as
  password (compared in constant time). A wrong token gets an ERROR command, a mechanism
  mismatch, a protocol error before READY or a peer presenting the identity of a live
  connection (ROUTER_HANDOVER=0) is closed; each is logged and counted as `peer_refused`
  (transport.security). A peer without an Identity gets 0x00 + a 4-byte counter.
* A message costs the receiver at most `max_message_bytes` plus one 64 KiB read buffer
  before it is refused: a cut message is reported to `on_oversized` (the endpoint counts
  it as `oversized`); the connection is closed at once, every other peer is served on.
* `recv_multipart` returns [identity, frames...]; each frame has `.buffer` (a memoryview
  over its own buffer: no copy after the read), `.bytes` and `len()`.
* `send_multipart([identity, *frames])` raises zmq.ZMQError(EHOSTUNREACH) for an unknown
  peer (ROUTER_MANDATORY); a message is written whole, never interleaved; while the
  peer's write buffer is above WRITE_HIGH_BYTES it waits for room, or raises zmq.Again
  with zmq.DONTWAIT. A frame may be any buffer; it must not change until sent (copy=False).
* A closed connection just disappears (its partial message too); `close(linger)` flushes
  pending writes for at most `linger` ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import os
import random
import socket
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import structlog
import zmq

from transport import zmtp
from transport.security import note_refused
from transport.throttle import Throttled

log = structlog.get_logger("transport")

FRAME_OVERHEAD_BYTES = 1024  # over-estimates what a received frame's objects cost
FREE_FRAMES = 64  # frames a message may have before their overhead counts
DIRECT_MIN_BYTES = 16 << 10  # a body with this much left is read straight into its buffer
WRITE_HIGH_BYTES = 16 << 20
BATCH_BYTES = 16 << 10  # frames smaller than this are joined into one write
TOKEN_REFUSED = "wrong or missing run token"

Oversized = Callable[[bytes | None, str], None]
_GREETING, _FLAGS, _SIZE, _BODY = range(4)


class Connection(asyncio.BufferedProtocol):
    """One peer: the greeting, the handshake, then frames into messages for `router`."""

    def __init__(self, router: ZmtpRouter) -> None:
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

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._state == _BODY and len(self._body) - self._filled >= DIRECT_MIN_BYTES:
            return self._body[self._filled :]
        return self.router.stage

    def buffer_updated(self, nbytes: int) -> None:
        if self._state == _BODY and len(self._body) - self._filled >= DIRECT_MIN_BYTES:
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
            view = zmtp.as_view(frame)
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


class ZmtpRouter:
    """The socket `RpcEndpoint` serves on (see the module docstring)."""

    type = zmq.ROUTER
    curve_server = False

    def __init__(
        self,
        address: str,
        *,
        name: str,
        max_message_bytes: int,
        hwm: int,
        linger_s: float,
        password: str | None = None,
        listen_fd: int | None = None,
    ) -> None:
        self.name = name
        self.max_message_bytes = max_message_bytes
        self.hwm = hwm
        self.linger_s = linger_s
        self.plain_server = password is not None
        self.mechanism = b"PLAIN" if password is not None else b"NULL"
        self._password = password.encode() if password is not None else b""
        self.on_oversized: Oversized = lambda peer, detail: None
        self.noisy = Throttled(log)
        self.closed = False
        self._peers: dict[bytes, Connection] = {}
        self._conns: set[Connection] = set()
        self._inbox: deque[list[Any]] = deque()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._paused: set[Connection] = set()
        self._anonymous = itertools.count(random.getrandbits(31))
        # One read buffer for all connections: a read is parsed out of it before the next.
        self.stage = memoryview(bytearray(zmtp.READ_BYTES))
        self._aio_server: asyncio.Server | None = None
        self.loop = asyncio.get_running_loop()
        self._listener, self.address, self._ipc_path = listen(address, listen_fd)
        self._server = self.loop.create_task(self._serve(), name=f"{name}.accept")

    async def _serve(self) -> None:
        self._aio_server = await self.loop.create_server(self._connection, sock=self._listener)

    def _connection(self) -> Connection:
        conn = Connection(self)
        self._conns.add(conn)
        return conn

    # --- what connections call --------------------------------------------------------------

    def password_ok(self, password: bytes) -> bool:
        return bool(password) and hmac.compare_digest(password, self._password)

    def anonymous_identity(self) -> bytes:
        return b"\x00" + (next(self._anonymous) & 0xFFFFFFFF).to_bytes(4, "big")

    def register(self, conn: Connection, identity: bytes) -> bool:
        if identity in self._peers or self.closed:
            return False
        self._peers[identity] = conn
        return True

    def lost(self, conn: Connection) -> None:
        self._conns.discard(conn)
        self._paused.discard(conn)
        if conn.identity is not None and self._peers.get(conn.identity) is conn:
            del self._peers[conn.identity]

    def deliver(self, conn: Connection, message: list[Any]) -> None:
        self._inbox.append(message)
        if len(self._inbox) >= self.hwm and conn.transport is not None:
            conn.transport.pause_reading()  # resumed when the endpoint takes messages again
            self._paused.add(conn)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break

    # --- the socket API RpcEndpoint uses ----------------------------------------------------

    async def recv_multipart(self, copy: bool = True) -> list[Any]:
        """The next message, [identity, *frames]: Frames, or bytes with `copy` (zmq's default)."""
        while not self._inbox:
            if self.closed:
                raise zmq.ZMQError(zmq.ENOTSOCK)
            waiter = self.loop.create_future()
            self._waiters.append(waiter)
            await waiter
        message = self._inbox.popleft()
        if self._paused and len(self._inbox) < self.hwm:
            for conn in self._paused:
                if not conn.closing and conn.transport is not None:
                    conn.transport.resume_reading()
            self._paused.clear()
        return [frame.bytes for frame in message] if copy else message

    async def send_multipart(self, frames: Sequence[Any], flags: int = 0, copy: bool = False) -> None:
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK)
        peer = frames[0]
        conn = self._peers.get(peer if isinstance(peer, bytes) else zmtp.as_view(peer).tobytes())
        if conn is None or conn.closing:
            raise zmq.ZMQError(zmq.EHOSTUNREACH)
        if not conn.writable:
            if flags & zmq.DONTWAIT:
                raise zmq.Again()
            await conn.drained()
            if conn.closing:
                raise zmq.ZMQError(zmq.EHOSTUNREACH)
        conn.write_message(frames[1:])

    def close(self, linger: int | None = None) -> None:
        """Stop listening, close every connection (pending writes get `linger` ms; None:
        the linger given at creation) and fail a waiting `recv_multipart`."""
        if self.closed:
            return
        self.closed = True
        self._server.cancel()
        if self._aio_server is not None:
            self._aio_server.close()  # also closes the listening socket
        else:
            self._listener.close()
        if self._ipc_path:
            with contextlib.suppress(OSError):
                os.unlink(self._ipc_path)
        linger_s = self.linger_s if linger is None else (None if linger < 0 else linger / 1000)
        for conn in list(self._conns):
            conn.close(linger_s)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)


def listen(address: str, listen_fd: int | None) -> tuple[socket.socket, str, str]:
    """A listening socket for `address` (or the one at `listen_fd`), the address it was
    bound to, as libzmq's LAST_ENDPOINT spells it, and the ipc path to unlink on close."""
    if listen_fd is not None:
        sock = socket.socket(fileno=listen_fd)
    elif address.startswith("ipc://"):
        path = address[len("ipc://") :]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # as libzmq does: a stale socket file from an earlier run
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
    elif address.startswith("tcp://"):
        host, _, port = address[len("tcp://") :].rpartition(":")
        host = host.strip("[]")
        host = "0.0.0.0" if host in ("*", "") else host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0 if port in ("*", "0") else int(port)))
    else:
        raise ValueError(f"transport: cannot serve {address!r} (tcp:// or ipc:// only)")
    if listen_fd is None:
        sock.listen(256)
    sock.setblocking(False)
    if sock.family == socket.AF_UNIX:
        path = sock.getsockname()
        return sock, f"ipc://{path}", path
    host, port = sock.getsockname()[:2]
    return sock, f"tcp://{f'[{host}]' if ':' in host else host}:{port}", ""
