"""A ZMTP 3.0 ROUTER in asyncio that bounds a whole message, not just each frame.

Why it exists: libzmq caps each frame (ZMQ_MAXMSGSIZE) but hands over a multipart
message only once all its frames arrived, with no cap on their sum or number, so a peer
holding the run token could make a server buffer any number of frames under the cap.
This server reads each frame's declared size before its body and closes the connection
of a peer whose message would exceed `max_message_bytes` (counting an overhead for every
frame past the first few: transport/zmtp_connection.py, so a flood of empty frames is cut too).

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
from typing import Any

import structlog
import zmq

from transport import zmtp
from transport.codec import as_buffer
from transport.throttle import Throttled
from transport.zmtp_connection import Connection

log = structlog.get_logger("transport")

Oversized = Callable[[bytes | None, str], None]


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
        conn = self._peers.get(peer if isinstance(peer, bytes) else as_buffer(peer).tobytes())
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
