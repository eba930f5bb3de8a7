"""ZeroMQ channels on asyncio: request/reply with correlation ids, heartbeats.

Guarantees a caller may rely on:

* Every socket has explicit high-water marks, a linger bound and (ROUTER) mandatory
  routing, so a send to an unknown peer is an error, not a silent loss.
* An endpoint never raises for bad input: a malformed, truncated, oversized,
  wrong-schema-version or unknown-type message is dropped, logged with the peer and the
  reason, and counted in `Endpoint.stats`.
* `RpcEndpoint.request` resolves with the reply carrying the same correlation id, raises
  `RemoteError` when the peer answered `Error`, and `RequestTimeout` after `timeout`.
* Heartbeats: every `heartbeat_s` an endpoint greets each peer it has not sent to
  recently; a peer silent for `peer_timeout_s` is reported once to `on_peer_lost`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import select
import sys
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq
import zmq.asyncio

from transport import wire
from transport.codec import Decoder, Encoder, WireError
from transport.security import CurveKeys, apply_curve, log_refused_handshakes

# Python >= 3.12 starts handler tasks eagerly (asyncio.Task(eager_start=True)).
_EAGER = sys.version_info >= (3, 12)
log = structlog.get_logger("transport")
UNSTICK_S = 0.05
DRAIN_BATCH = 256  # messages one descriptor callback handles before yielding to the loop
MAX_POLL_BACKOFF = 1024  # most requests of a type left unpolled after a slow reply
SLOW_REPLY_WINDOWS = 4  # a reply later than this many poll windows is a slow one
# pyzmq's constants are enum.IntFlag members: every `events & zmq.POLLIN` builds a new
# flag object (about a microsecond each, several per message). The hot path uses ints.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)

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
    # RpcEndpoint.request polls for its reply this long before it sleeps (0: never); see
    # RpcEndpoint._busy_poll.
    busy_poll_us: int = 200


@dataclass
class ChannelStats:
    """Counters of one endpoint; `dropped` is keyed by drop reason."""

    sent: int = 0
    received: int = 0
    bytes_received: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    kicks: int = 0  # times the safety net found socket events nobody had handled (RpcEndpoint._unstick)
    polled: int = 0  # requests answered while busy-polling (ChannelOptions.busy_poll_us)
    poll_misses: int = 0  # busy polls that ran out of time; the request then slept


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
    """One zmq socket with the wire codec, size caps and drop accounting (the base of
    `RpcEndpoint`, which drives the socket)."""

    def __init__(self, sock: zmq.Socket, name: str, options: ChannelOptions) -> None:
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

    async def _send(self, msg: wire.Message, peer: bytes | None, corr: int, flags: int) -> None:
        frames = self._frames(msg, peer, corr, flags)
        try:
            await self.sock.send_multipart(frames, copy=False)
        except zmq.ZMQError as exc:
            self._raise_send_error(exc, peer)
        self._sent(peer)

    def _frames(self, msg: wire.Message, peer: bytes | None, corr: int, flags: int) -> list[Any]:
        frames = self._encoder.encode(msg, corr=corr, flags=flags)
        if self.is_router:
            if peer is None:
                raise ValueError(f"{self.name}: a ROUTER send needs a peer")
            frames.insert(0, peer)
        return frames

    def _raise_send_error(self, exc: zmq.ZMQError, peer: bytes | None) -> None:
        if exc.errno == zmq.EHOSTUNREACH:
            raise PeerUnreachable(f"{self.name}: peer {_peer_name(peer)} is not connected") from None
        raise exc

    def _sent(self, peer: bytes | None) -> None:
        self.stats.sent += 1
        self.last_sent[peer] = time.monotonic()

    def _accept_frames(self, frames: list[Any]) -> Envelope | None:
        peer = None
        if self.is_router:
            peer, frames = frames[0].bytes, frames[1:]
        return self._accept(frames, peer)

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

    Call `start(handler)` once: from then on every message is dispatched as it arrives,
    and a heartbeat task runs. Each incoming non-reply message is passed to `handler`,
    which runs in a task of its own (on Python >= 3.12 an eager one: it runs at once up to
    its first `await`, and most handlers finish there); a non-None return value is sent
    back as the reply when the message had a correlation id. Handler exceptions become
    `wire.Error` replies.

    The socket is a plain zmq socket driven from its descriptor on the running loop: a
    reader callback drains every message that has arrived (NOBLOCK receives, no future
    per message) and resolves replies in place; a send goes out at once when the queue
    has room and otherwise waits for room. Against zmq.asyncio this saves one event-loop
    hop per side of a round trip and most of the per-message bookkeeping.

    With `ChannelOptions.busy_poll_us` > 0, `request` polls the socket for its reply for
    up to that long before it sleeps, when it is the endpoint's only outstanding request
    (see `_busy_poll`; `stats.polled` and `stats.poll_misses` count the outcomes).
    """

    def __init__(self, sock: zmq.Socket, name: str, options: ChannelOptions) -> None:
        super().__init__(sock, name, options)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handler: Handler | None = None
        self._send_waiters: deque[asyncio.Future[None]] = deque()
        self._scheduled = False  # an _on_events call is queued on the loop
        self._corr = itertools.count(1)
        self._pending: dict[int, tuple[bytes | None, asyncio.Future[wire.Message]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[Any]] = []
        self._lost: set[bytes | None] = set()
        self.on_peer_lost: PeerLost | None = None
        self.known_peers: set[bytes | None] = set() if self.is_router else {None}
        self._busy_poll_s = options.busy_poll_us / 1e6
        # Request type -> [requests still to skip, current backoff]; see _poll_missed.
        self._poll_backoff: dict[type, list[int]] = {}

    def start(self, handler: Handler | None = None, *, on_peer_lost: PeerLost | None = None) -> None:
        self.on_peer_lost = on_peer_lost
        self._handler = handler
        if not self.is_router:
            self.last_seen.setdefault(None, time.monotonic())
        self._watch()
        self._loops = [
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
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[wire.Message] = loop.create_future()
        self._pending[corr] = (peer, fut)
        deadline = loop.time() + timeout
        timer: asyncio.TimerHandle | None = None
        missed_poll_from: float | None = None  # when a busy poll that ran out began
        try:
            frames = self._frames(msg, peer, corr, 0)
            if not self._try_send(frames, peer):
                # The timeout covers the send too: a send to a peer whose queue is full (or
                # a DEALER whose server is gone) waits until the high-water mark frees up.
                async with asyncio.timeout_at(deadline):
                    await self._send_when_room(frames, peer)
            if self._busy_poll_s and self._loop and len(self._pending) == 1 and self._may_poll(type(msg)):
                started = time.perf_counter()
                if not self._busy_poll(fut, type(msg), started):
                    missed_poll_from = started
            if not fut.done():
                timer = loop.call_at(deadline, _expire, fut)
            reply = await fut
        except TimeoutError:
            raise RequestTimeout(
                f"{self.name}: {type(msg).__name__} to {_peer_name(peer)} got no reply in {timeout:g}s"
            ) from None
        finally:
            self._pending.pop(corr, None)
            if timer is not None:
                timer.cancel()
            if missed_poll_from is not None:
                self._poll_missed(type(msg), time.perf_counter() - missed_poll_from)
        if isinstance(reply, wire.Error):
            raise RemoteError(reply.code, reply.message)
        return reply

    def _busy_poll(self, fut: asyncio.Future[wire.Message], kind: type, started: float) -> bool:
        """Poll the socket for `fut`'s reply until `busy_poll_us` after `started` (a
        `time.perf_counter()` reading), handling whatever arrives meanwhile as the
        descriptor callback would; True if `fut` is done.

        A process asleep in the event loop's poll is woken by the kernel when the reply
        lands; on a small VM that wake-up is a large share of a short round trip. Polling
        instead costs CPU and holds the event loop, for at most the window; it yields the
        CPU between looks, so on a busy machine it does not hold up the threads that
        produce the reply (or anyone else). Request types whose replies take far longer
        than the window stop being polled for (see `_poll_missed`)."""
        sock = self.sock
        end = started + self._busy_poll_s
        while not fut.done() and not sock.closed:
            if self._has_work(sock.getsockopt(_EVENTS)):
                self._on_events()
            elif time.perf_counter() >= end:
                self.stats.poll_misses += 1
                return False
            else:
                os.sched_yield()  # anything runnable on this CPU (the peer, zmq's I/O thread) goes first
        if fut.done():
            self.stats.polled += 1
            self._poll_backoff.pop(kind, None)
        return fut.done()

    def _poll_missed(self, kind: type, waited_s: float) -> None:
        """A poll for a `kind` request ran out; its reply (or failure) came `waited_s`
        after the poll began. A near miss (within SLOW_REPLY_WINDOWS windows) changes
        nothing: replies of this type are short and the next poll may well catch one.
        A slow one (a training step) skips polling for the next 1, then 2, 4, ... (at
        most MAX_POLL_BACKOFF) requests of that type, so a run of slow requests costs
        about log2(n) windows; a poll that catches a reply resets it."""
        if waited_s <= SLOW_REPLY_WINDOWS * self._busy_poll_s:
            return
        backoff = self._poll_backoff.setdefault(kind, [0, 0])
        backoff[1] = min(max(1, 2 * backoff[1]), MAX_POLL_BACKOFF)
        backoff[0] = backoff[1]

    def _may_poll(self, kind: type) -> bool:
        """False while requests of `kind` are skipped after slow replies (see `_poll_missed`)."""
        backoff = self._poll_backoff.get(kind)
        if backoff is None or backoff[0] == 0:
            return True
        backoff[0] -= 1
        return False

    async def _send(self, msg: wire.Message, peer: bytes | None, corr: int, flags: int) -> None:
        frames = self._frames(msg, peer, corr, flags)
        if not self._try_send(frames, peer):
            await self._send_when_room(frames, peer)

    async def _send_when_room(self, frames: list[Any], peer: bytes | None) -> None:
        """After `_try_send` found the queue full: wait for room, send, repeat until sent."""
        attempt = 0
        while True:
            await self._room(attempt)
            if self._try_send(frames, peer):
                return
            attempt += 1

    def _try_send(self, frames: list[Any], peer: bytes | None) -> bool:
        """Send now if the queue has room; False when it is full (the caller waits)."""
        try:
            _send_frames(self.sock, frames)
            sent = True
        except zmq.Again:
            sent = False
        except zmq.ZMQError as exc:
            self._raise_send_error(exc, peer)
        finally:
            if self._loop is not None:
                self._recheck()
        if sent:
            self._sent(peer)
        return sent

    async def _room(self, attempt: int) -> None:
        """Wait until the socket may take a message again."""
        self._watch()
        assert self._loop is not None
        if self._recheck() & _POLLOUT:
            # Room, but not toward this peer (a ROUTER whose peer's queue is full): no
            # descriptor event will say when that peer drains, so poll with a backoff.
            await asyncio.sleep(min(0.001 * 2**attempt, 0.05))
            return
        fut = self._loop.create_future()
        self._send_waiters.append(fut)
        try:
            await fut
        finally:
            if not fut.done():
                fut.cancel()

    def _recheck(self) -> int:
        """Read the socket's events and have `_on_events` act on them if needed.

        Any operation on the socket (a send, even a failed one, or reading EVENTS) handles
        its pending commands and so resets its descriptor: input that arrived meanwhile,
        or room that opened for a waiting sender, would not be signalled again. Every such
        operation outside `_on_events` is followed by this."""
        if self.sock.closed:
            return 0
        events: int = self.sock.getsockopt(_EVENTS)
        if self._has_work(events):
            self._schedule()
        return events

    def _has_work(self, events: int) -> bool:
        """Whether `events` hold something for `_on_events`: input, or room a sender waits for."""
        return bool(events & _POLLIN or (events & _POLLOUT and self._send_waiters))

    def _watch(self) -> None:
        """Start reacting to the socket's descriptor (idempotent; needs a running loop)."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.sock.FD, self._on_events)
        self._schedule()

    def _schedule(self) -> None:
        """Run `_on_events` soon (once, however often this is called before it runs)."""
        if not self._scheduled:
            self._scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._on_events)

    def _on_events(self) -> None:
        """Dispatch every message that has arrived, then wake senders waiting for room.

        The descriptor is edge-triggered: reading ZMQ_EVENTS handles the socket's pending
        commands and resets it, so every bit read must be acted on here."""
        self._scheduled = False
        sock = self.sock
        if sock.closed:
            return
        try:
            events = sock.getsockopt(_EVENTS)
            for _ in range(DRAIN_BATCH):
                if not events & _POLLIN:
                    break
                env = self._accept_frames(_recv_frames(sock))
                if env is not None:
                    self._dispatch_safely(env)
                events = sock.getsockopt(_EVENTS)
            else:
                if events & _POLLIN:
                    self._schedule()  # more waiting: let other callbacks run first
        except zmq.Again:  # EVENTS said POLLIN, yet nothing came: look again next round
            events = sock.getsockopt(_EVENTS)
            if events & _POLLIN:
                self._schedule()
        except zmq.ZMQError as exc:
            if sock.closed:
                return
            # A socket error is no peer's message: the endpoint must outlive it.
            log.warning("recv_failed", channel=self.name, error=repr(exc))
            assert self._loop is not None
            self._loop.call_later(0.01, self._on_events)
            return
        if events & _POLLOUT:
            while self._send_waiters:
                waiter = self._send_waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)

    def _dispatch_safely(self, env: Envelope) -> None:
        try:
            self._dispatch(env, self._handler)
        except Exception as exc:  # a bug here must not stop the drain (nothing would resume it)
            log.error("dispatch_failed", channel=self.name, msg=type(env.msg).__name__, error=repr(exc))

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
            self._start(self._handle(handler, env))

    def _start(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a handler as a task of its own. On Python >= 3.12 the task starts eagerly:
        it runs now, up to its first wait, and most handlers answer without ever being
        scheduled. Either way the handler runs inside its task, so `asyncio.current_task()`,
        `asyncio.timeout()` and (3.12) `asyncio.wait_for()` work before its first await."""
        loop = asyncio.get_running_loop()
        if _EAGER:
            task = asyncio.Task(coro, loop=loop, eager_start=True)  # type: ignore[call-arg]
            if task.done():
                return
        else:
            task = loop.create_task(coro)
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
        """Safety net for a lost wake-up: every UNSTICK_S, if the socket has input waiting
        (or room while a sender waits for it) that no descriptor event announced, handle
        it now, so nothing waits in the socket longer than that. `stats.kicks` counts the
        times it acted. A zmq descriptor is edge-triggered, and any operation on the socket
        can consume the edge; `_try_send` re-checks after each send, and this covers any
        path that was missed."""
        while True:
            await asyncio.sleep(UNSTICK_S)
            if self.sock.closed:
                return
            if self._scheduled or select.select([self.sock.FD], [], [], 0)[0]:
                continue  # the loop will run _on_events anyway
            if self._has_work(self.sock.getsockopt(_EVENTS)):
                self.stats.kicks += 1
                self._on_events()

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
                self._greet(peer)

    def _greet(self, peer: bytes | None) -> None:
        """Send a heartbeat if it can leave now; a full or dead peer queue must not stall liveness checks."""
        try:
            self._try_send(self._frames(wire.Heartbeat(sent_at=time.time()), peer, 0, 0), peer)
        except (PeerUnreachable, zmq.ZMQError):
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
        """Cancel the loops and handler tasks, fail pending requests, close the socket;
        logs the endpoint's counters (`channel_closed`)."""
        st = self.stats
        log.info(
            "channel_closed", channel=self.name, sent=st.sent, received=st.received,
            dropped=dict(st.dropped), kicks=st.kicks, polled=st.polled, poll_misses=st.poll_misses,
        )  # fmt: skip
        for task in [*self._loops, *self._tasks]:
            task.cancel()
        await asyncio.gather(*self._loops, *self._tasks, return_exceptions=True)
        for fut in [*(f for _, f in self._pending.values()), *self._send_waiters]:
            if not fut.done():
                fut.set_exception(ConnectionError(f"{self.name}: closed"))
        self.close()

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed() and not self.sock.closed:
            self._loop.remove_reader(self.sock.FD)
        super().close()


def _send_frames(sock: zmq.Socket, frames: list[Any]) -> None:
    """`send_multipart(frames, NOBLOCK, copy=False)` with int flags (see `_POLLIN`).
    zmq takes a multipart message whole or not at all: only the first frame can raise
    `zmq.Again`."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, _NOBLOCK | _SNDMORE if i < last else _NOBLOCK, copy=False)


def _recv_frames(sock: zmq.Socket) -> list[zmq.Frame]:
    """`recv_multipart(NOBLOCK, copy=False)` without a getsockopt call per frame: a
    received `zmq.Frame` already knows whether more parts follow."""
    frame = sock.recv(_NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(_NOBLOCK, copy=False)
        frames.append(frame)
    return frames


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


def _peer_name(peer: bytes | None) -> str:
    if peer is None:
        return "server"
    try:
        return peer.decode()
    except UnicodeDecodeError:
        return peer.hex()


def _configure(sock: zmq.Socket, options: ChannelOptions) -> None:
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
    sock = ctx.socket(zmq.ROUTER, socket_class=zmq.Socket)  # plain: RpcEndpoint drives it
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
    sock = ctx.socket(zmq.DEALER, socket_class=zmq.Socket)  # plain: RpcEndpoint drives it
    _configure(sock, options)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    if options.curve is not None:
        apply_curve(sock, options.curve, server=False)
    sock.connect(address)
    ep = RpcEndpoint(sock, name, options)
    ep.address = address
    return ep


def _bind(sock: zmq.Socket, address: str) -> str:
    if address.startswith("tcp://") and address.endswith(":0"):
        address = address[:-2] + ":*"
    sock.bind(address)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
