"""zmq.asyncio channels: request/reply with correlation ids, fan-out, heartbeats.

Guarantees a caller may rely on:

* Every socket has explicit high-water marks, a linger bound and (ROUTER) mandatory
  routing, so a send to an unknown peer is an error, not a silent loss.
* `Endpoint.recv` never raises for bad input: a malformed, truncated, oversized,
  wrong-schema-version or unknown-type message is dropped, logged with the peer and the
  reason, and counted in `Endpoint.stats`; the next good message is returned.
* `RpcEndpoint.request` resolves with the reply carrying the same correlation id, raises
  `RemoteError` when the peer answered `Error`, and `RequestTimeout` after `timeout`.
* Heartbeats: every `heartbeat_s` an endpoint greets each peer it has not sent to
  recently; a peer silent for `peer_timeout_s` is reported once to `on_peer_lost`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq
import zmq.asyncio

from transport import wire
from transport.codec import Decoder, Encoder, WireError
from transport.security import CurveKeys, apply_curve, log_refused_handshakes

log = structlog.get_logger("transport")
UNSTICK_S = 0.05

Handler = Callable[["Envelope"], Awaitable[wire.Message | None]]
PeerLost = Callable[[bytes | None], Awaitable[None] | None]


@dataclass(frozen=True)
class ChannelOptions:
    """Socket policy. Sizes in bytes, times in seconds."""

    hwm: int = 1000
    max_message_bytes: int = 1 << 30
    linger_s: float = 1.0
    heartbeat_s: float = 1.0
    peer_timeout_s: float = 10.0
    inline_threshold: int = 256
    curve: CurveKeys | None = None


@dataclass
class ChannelStats:
    """Counters of one endpoint; `dropped` is keyed by drop reason."""

    sent: int = 0
    received: int = 0
    bytes_received: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    kicks: int = 0  # times the receive safety net found input waiting (see RpcEndpoint._unstick)


@dataclass(slots=True)
class Envelope:
    """A received message with its header and (ROUTER side) the sender's identity."""

    msg: wire.Message
    header: wire.Header
    peer: bytes | None = None


class RequestTimeout(TimeoutError):
    """No reply within the request's timeout."""


class RemoteError(RuntimeError):
    """The peer answered a request with `wire.Error`."""

    def __init__(self, code: wire.ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class PeerUnreachable(ConnectionError):
    """A ROUTER send named a peer that is not connected."""


class Endpoint:
    """One zmq.asyncio socket with the wire codec, size caps and drop accounting."""

    def __init__(self, sock: zmq.asyncio.Socket, name: str, options: ChannelOptions) -> None:
        self.sock = sock
        self.name = name
        self.options = options
        self.stats = ChannelStats()
        self.is_router = sock.type == zmq.ROUTER
        self._encoder = Encoder(options.inline_threshold)
        self._decoder = Decoder()
        self.last_sent: dict[bytes | None, float] = {}
        self.last_seen: dict[bytes | None, float] = {}
        self.address = ""

    async def send(self, msg: wire.Message, *, peer: bytes | None = None, corr: int = 0, flags: int = 0) -> None:
        """Send one message (to `peer` on a ROUTER). Raises PeerUnreachable if unrouted."""
        await self._send(msg, peer, corr, flags)

    async def _send(self, msg: wire.Message, peer: bytes | None, corr: int, flags: int, zmq_flags: int = 0) -> None:
        frames = self._encoder.encode(msg, corr=corr, flags=flags)
        if self.is_router:
            if peer is None:
                raise ValueError(f"{self.name}: a ROUTER send needs a peer")
            frames.insert(0, peer)
        try:
            await self.sock.send_multipart(frames, flags=zmq_flags, copy=False)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise PeerUnreachable(f"{self.name}: peer {_peer_name(peer)} is not connected") from None
            raise
        self.stats.sent += 1
        self.last_sent[peer] = time.monotonic()

    async def recv(self) -> Envelope:
        """The next acceptable message; bad ones are dropped, logged and counted."""
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            peer = None
            if self.is_router:
                peer, frames = frames[0].bytes, frames[1:]
            env = self._accept(frames, peer)
            if env is not None:
                return env

    def _accept(self, frames: list[Any], peer: bytes | None) -> Envelope | None:
        self.last_seen[peer] = time.monotonic()
        size = sum(map(len, frames))  # zmq frames: len() is the byte size
        self.stats.bytes_received += size
        try:
            if size > self.options.max_message_bytes:
                raise WireError("oversized", f"{size} bytes > max {self.options.max_message_bytes}")
            header, msg = self._decoder.decode(frames)
        except WireError as exc:
            self.stats.dropped[exc.reason] += 1
            log.warning(
                "message_dropped",
                channel=self.name,
                peer=_peer_name(peer),
                reason=exc.reason,
                detail=exc.detail[:200],
            )
            return None
        self.stats.received += 1
        return Envelope(msg=msg, header=header, peer=peer)

    def close(self) -> None:
        self.sock.close(linger=int(self.options.linger_s * 1000))


class RpcEndpoint(Endpoint):
    """Request/reply and one-way messages over ROUTER (server) or DEALER (client).

    Call `start(handler)` once: it runs the receive loop and the heartbeat loop as
    tasks. Each incoming non-reply message is passed to `handler` in its own task;
    a non-None return value is sent back as the reply when the message had a
    correlation id. Handler exceptions become `wire.Error` replies.
    """

    def __init__(self, sock: zmq.asyncio.Socket, name: str, options: ChannelOptions) -> None:
        super().__init__(sock, name, options)
        self._corr = itertools.count(1)
        self._pending: dict[int, tuple[bytes | None, asyncio.Future[wire.Message]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[Any]] = []
        self._lost: set[bytes | None] = set()
        self.on_peer_lost: PeerLost | None = None
        self.known_peers: set[bytes | None] = set() if self.is_router else {None}

    def start(self, handler: Handler | None = None, *, on_peer_lost: PeerLost | None = None) -> None:
        self.on_peer_lost = on_peer_lost
        self.last_seen.setdefault(None, time.monotonic()) if not self.is_router else None
        self._loops = [
            asyncio.create_task(self._serve(handler), name=f"{self.name}.recv"),
            asyncio.create_task(self._heartbeat(), name=f"{self.name}.heartbeat"),
            asyncio.create_task(self._unstick(), name=f"{self.name}.unstick"),
        ]
        if self.options.curve is not None and self.sock.curve_server:
            watch = log_refused_handshakes(self.sock, self.name)
            self._loops.append(asyncio.create_task(watch, name=f"{self.name}.handshakes"))
        for task in self._loops:
            task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task[Any]) -> None:
        # Nobody awaits these tasks: without this an endpoint could stop serving in silence.
        if not task.cancelled() and task.exception() is not None:
            log.error("channel_loop_died", channel=self.name, loop=task.get_name(), error=repr(task.exception()))

    async def request(self, msg: wire.Message, *, peer: bytes | None = None, timeout: float) -> wire.Message:
        """Send `msg` and wait for its reply; see the class docstring for errors."""
        corr = next(self._corr)
        fut: asyncio.Future[wire.Message] = asyncio.get_running_loop().create_future()
        self._pending[corr] = (peer, fut)
        try:
            # The timeout covers the send too: a send to a peer whose queue is full (or a
            # DEALER whose server is gone) blocks until the high-water mark frees up.
            async with asyncio.timeout(timeout):
                await self._send(msg, peer, corr, 0)
                reply = await fut
        except TimeoutError:
            raise RequestTimeout(
                f"{self.name}: {type(msg).__name__} to {_peer_name(peer)} got no reply in {timeout:g}s"
            ) from None
        finally:
            self._pending.pop(corr, None)
        if isinstance(reply, wire.Error):
            raise RemoteError(reply.code, reply.message)
        return reply

    async def reply(self, env: Envelope, msg: wire.Message) -> None:
        await self._send(msg, env.peer, env.header.corr, wire.Flag.REPLY)

    def forget(self, peer: bytes | None) -> None:
        """Stop tracking `peer` (it left); its pending requests fail as unreachable."""
        self.known_peers.discard(peer)
        self.last_seen.pop(peer, None)
        for corr, (p, fut) in list(self._pending.items()):
            if p == peer and not fut.done():
                fut.set_exception(PeerUnreachable(f"{self.name}: peer {_peer_name(peer)} was lost"))
                self._pending.pop(corr, None)

    async def _serve(self, handler: Handler | None) -> None:
        while True:
            try:
                env = await self.recv()
            except zmq.ZMQError as exc:
                if self.sock.closed:
                    return
                # A socket error is no peer's message: the loop must outlive it.
                log.warning("recv_failed", channel=self.name, error=repr(exc))
                await asyncio.sleep(0.01)
                continue
            self._dispatch(env, handler)

    def _dispatch(self, env: Envelope, handler: Handler | None) -> None:
        if env.peer is not None:
            self.known_peers.add(env.peer)
        if env.peer in self._lost:
            # Back after being reported lost: a later silence is reported again.
            self._lost.discard(env.peer)
            log.info("peer_back", channel=self.name, peer=_peer_name(env.peer))
        if env.header.flags & wire.Flag.REPLY:
            self._resolve(env)
        elif handler is not None and not isinstance(env.msg, wire.Heartbeat):
            task = asyncio.create_task(self._handle(handler, env))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _resolve(self, env: Envelope) -> None:
        entry = self._pending.get(env.header.corr)
        if entry is None or entry[0] != env.peer or entry[1].done():
            self.stats.dropped["late_reply"] += 1
            return
        entry[1].set_result(env.msg)

    async def _handle(self, handler: Handler, env: Envelope) -> None:
        try:
            result = await handler(env)
        except Exception as exc:
            log.warning("handler_failed", channel=self.name, msg=type(env.msg).__name__, error=repr(exc))
            result = wire.Error(code=wire.ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}")
        if result is None or not env.header.corr:
            return
        try:
            await self._send(result, env.peer, env.header.corr, wire.Flag.REPLY)
        except PeerUnreachable as exc:
            log.warning("reply_unroutable", channel=self.name, error=str(exc))
        except Exception as exc:
            # An unencodable result must not leave the requester waiting for its timeout.
            log.warning("reply_failed", channel=self.name, msg=type(result).__name__, error=repr(exc))
            error = wire.Error(code=wire.ErrorCode.INTERNAL, message=f"reply not sent: {type(exc).__name__}: {exc}")
            try:
                await self._send(error, env.peer, env.header.corr, wire.Flag.REPLY)
            except Exception as exc2:
                log.warning("reply_unroutable", channel=self.name, error=repr(exc2))

    async def _unstick(self) -> None:
        """Safety net for a lost wake-up of the receive loop.

        A zmq socket's descriptor is edge-triggered: an edge consumed without the waiting
        receive being woken leaves a message in the socket until something else re-reads
        its events. On a busy 2-core machine a rollout handled an Abort seconds after the
        Generate sent just before it on the same socket; a lost edge is the suspected (not
        proven) cause. Every UNSTICK_S this checks for input waiting and, if there is some,
        has zmq.asyncio handle it (reading EVENTS through the asyncio socket schedules that),
        so no message can wait longer than that; `stats.kicks` counts the checks that found
        input waiting."""
        shadow = zmq.Socket.shadow(self.sock.underlying)
        while True:
            await asyncio.sleep(UNSTICK_S)
            if self.sock.closed:
                return
            if shadow.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self.stats.kicks += 1
                self.sock.get(zmq.EVENTS)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.options.heartbeat_s)
            try:
                await self._check_peers(time.monotonic())
            except zmq.ZMQError as exc:
                if self.sock.closed:
                    return
                log.warning("heartbeat_failed", channel=self.name, error=repr(exc))

    async def _check_peers(self, now: float) -> None:
        """Report peers silent for longer than peer_timeout_s (once each), greet the quiet ones."""
        opts = self.options
        for peer in list(self.known_peers):
            seen = self.last_seen.get(peer, now)
            if now - seen > opts.peer_timeout_s and peer not in self._lost:
                self._lost.add(peer)
                log.warning("peer_silent", channel=self.name, peer=_peer_name(peer), silent_s=round(now - seen, 2))
                await self._report_lost(peer)
            if now - self.last_sent.get(peer, 0.0) >= opts.heartbeat_s:
                await self._greet(peer)

    async def _greet(self, peer: bytes | None) -> None:
        """Send a heartbeat if it can leave soon; a full or dead peer queue must not stall liveness checks."""
        try:
            async with asyncio.timeout(self.options.heartbeat_s):
                await self._send(wire.Heartbeat(sent_at=time.time()), peer, 0, 0, zmq.NOBLOCK)
        except (TimeoutError, PeerUnreachable, zmq.Again):
            pass

    async def _report_lost(self, peer: bytes | None) -> None:
        if self.on_peer_lost is None:
            return
        try:
            result = self.on_peer_lost(peer)
            if asyncio.iscoroutine(result):
                await result
        except Exception as exc:
            log.warning("on_peer_lost_failed", channel=self.name, peer=_peer_name(peer), error=repr(exc))

    async def aclose(self) -> None:
        """Cancel the loops and handler tasks, fail pending requests, close the socket."""
        for task in [*self._loops, *self._tasks]:
            task.cancel()
        await asyncio.gather(*self._loops, *self._tasks, return_exceptions=True)
        for _, fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError(f"{self.name}: closed"))
        self.close()


def _peer_name(peer: bytes | None) -> str:
    if peer is None:
        return "server"
    try:
        return peer.decode()
    except UnicodeDecodeError:
        return peer.hex()


def _configure(sock: zmq.asyncio.Socket, options: ChannelOptions) -> None:
    sock.setsockopt(zmq.SNDHWM, options.hwm)
    sock.setsockopt(zmq.RCVHWM, options.hwm)
    sock.setsockopt(zmq.LINGER, int(options.linger_s * 1000))
    # Hard per-frame cap at the socket; the logical per-message cap (with logging and
    # counting) is applied in Endpoint._accept, below this one.
    sock.setsockopt(zmq.MAXMSGSIZE, 4 * options.max_message_bytes)


def bind_router(
    ctx: zmq.asyncio.Context, address: str, *, name: str, options: ChannelOptions = ChannelOptions()
) -> RpcEndpoint:
    """A ROUTER bound at `address` (tcp port 0 or `*` picks a free port; see `.address`)."""
    sock = ctx.socket(zmq.ROUTER)
    _configure(sock, options)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if options.curve is not None:
        apply_curve(sock, options.curve, server=True)
    ep = RpcEndpoint(sock, name, options)
    ep.address = _bind(sock, address)
    return ep


def connect_dealer(
    ctx: zmq.asyncio.Context,
    address: str,
    *,
    name: str,
    identity: str,
    options: ChannelOptions = ChannelOptions(),
) -> RpcEndpoint:
    """A DEALER with routing identity `identity`, connected to `address`."""
    sock = ctx.socket(zmq.DEALER)
    _configure(sock, options)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    if options.curve is not None:
        apply_curve(sock, options.curve, server=False)
    sock.connect(address)
    ep = RpcEndpoint(sock, name, options)
    ep.address = address
    return ep


def bind_socket(
    ctx: zmq.asyncio.Context,
    kind: int,
    address: str,
    *,
    name: str,
    options: ChannelOptions = ChannelOptions(),
) -> Endpoint:
    """A bound fan-out socket (zmq.PUB or zmq.PUSH, or the receiving PULL/SUB)."""
    sock = ctx.socket(kind)
    _configure(sock, options)
    if options.curve is not None:
        apply_curve(sock, options.curve, server=True)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    ep = Endpoint(sock, name, options)
    ep.address = _bind(sock, address)
    return ep


def connect_socket(
    ctx: zmq.asyncio.Context,
    kind: int,
    address: str,
    *,
    name: str,
    options: ChannelOptions = ChannelOptions(),
) -> Endpoint:
    """A connected fan-out socket (zmq.SUB subscribes to everything)."""
    sock = ctx.socket(kind)
    _configure(sock, options)
    if options.curve is not None:
        apply_curve(sock, options.curve, server=False)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(address)
    ep = Endpoint(sock, name, options)
    ep.address = address
    return ep


def _bind(sock: zmq.asyncio.Socket, address: str) -> str:
    if address.startswith("tcp://") and address.endswith(":0"):
        address = address[:-2] + ":*"
    sock.bind(address)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
