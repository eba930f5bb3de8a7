"""Request/reply over one ROUTER (server: transport.zmtp_router's, or zmq.asyncio's with
Curve) or zmq.asyncio DEALER (client) socket.

Guarantees a caller may rely on:

* `RpcEndpoint.request` resolves with the reply carrying its correlation id, raises
  `RemoteError` when the peer answered `wire.Error`, `PeerUnreachable` when a ROUTER
  names a peer that is not connected (or that was `forget`-ten meanwhile), and
  `RequestTimeout` after `timeout`. The timeout covers the send too: a send waits for
  room while the peer's queue is at its high-water mark.
* Each incoming request runs `handler` in a task of its own; a non-None result is sent
  back as the reply when the message had a correlation id. A handler exception (any but
  a cancellation or an interpreter exit: torch's `CheckpointException` is a
  BaseException), or a result that cannot be encoded, becomes a `wire.Error` reply, so a
  requester never waits out its timeout for a failure on the other side.
* Bad input never stops an endpoint: it is dropped, logged and counted (see
  `transport.endpoint`), and so is a late reply (`stats.dropped["late_reply"]`).
* Heartbeats: every `heartbeat_s` an endpoint greets each peer it has not sent to
  recently; a peer silent for `peer_timeout_s` is reported once to `on_peer_lost`, and
  once more after each time it is heard from again (`peer_back`). Its `peer_silent` log is
  a warning when the peer had been heard from, info when never (it may not be up yet).
* `aclose` returns within about a second: it cancels the endpoint's tasks, fails its
  pending requests with `ConnectionError` and closes the socket with its linger bound.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog
import zmq
import zmq.asyncio

from transport import wire
from transport.endpoint import ChannelOptions, Endpoint, Envelope, peer_name
from transport.security import log_refused_handshakes
from transport.throttle import Throttled
from transport.zmtp_router import ZmtpRouter

log = structlog.get_logger("transport")

Handler = Callable[[Envelope], Awaitable[wire.Message | None]]
PeerLost = Callable[[bytes | None], Awaitable[None] | None]

CLOSE_WAIT_S = 1.0  # how long aclose waits for cancelled handlers to finish
RECV_RETRY_S = 0.01  # pause after a socket error before receiving again
ROOM_POLL_S = (0.001, 0.05)  # first and longest pause before retrying a send to a full peer


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


class RpcEndpoint(Endpoint):
    """Requests, replies and one-way messages; call `start` once to begin serving."""

    def __init__(self, sock: zmq.asyncio.Socket | ZmtpRouter, name: str, options: ChannelOptions) -> None:
        super().__init__(name, options, is_router=sock.type == zmq.ROUTER)
        self.sock = sock
        self.address = ""
        self.known_peers: set[bytes | None] = set() if self.is_router else {None}
        self.on_peer_lost: PeerLost | None = None
        self._handler: Handler | None = None
        self._corr = itertools.count(1)
        self._pending: dict[int, tuple[bytes | None, asyncio.Future[wire.Message]]] = {}
        self._lost: set[bytes | None] = set()
        self._heard: set[bytes | None] = set()  # peers anything arrived from: only their silence is a fault
        self._loops: list[asyncio.Task[None]] = []
        self._handlers: set[asyncio.Task[None]] = set()
        self.noisy = Throttled(log)

    def start(self, handler: Handler | None = None, *, on_peer_lost: PeerLost | None = None) -> None:
        """Receive and dispatch every message from now on, and send heartbeats. Replies
        resolve their requests; other messages (heartbeats aside) go to `handler`."""
        self._handler = handler
        self.on_peer_lost = on_peer_lost
        if not self.is_router:
            self.last_seen.setdefault(None, time.monotonic())
        loops: dict[str, Coroutine[Any, Any, None]] = {"receive": self._receive(), "heartbeat": self._heartbeat()}
        if self.sock.curve_server or self.sock.plain_server:
            loops["handshakes"] = log_refused_handshakes(self.sock, self.name)
        for what, coro in loops.items():
            task = asyncio.create_task(coro, name=f"{self.name}.{what}")
            task.add_done_callback(self._loop_ended)
            self._loops.append(task)

    async def request(self, msg: wire.Message, *, peer: bytes | None = None, timeout: float) -> wire.Message:
        """Send `msg` and wait for its reply; see the module docstring for the errors."""
        corr = next(self._corr)
        reply: asyncio.Future[wire.Message] = asyncio.get_running_loop().create_future()
        self._pending[corr] = (peer, reply)
        try:
            async with asyncio.timeout(timeout):
                await self._send(msg, peer, corr, 0)
                answer = await reply
        except TimeoutError:
            raise RequestTimeout(
                f"{self.name}: {type(msg).__name__} to {peer_name(peer)} got no reply in {timeout:g}s"
            ) from None
        finally:
            self._pending.pop(corr, None)
            if reply.done() and not reply.cancelled():
                reply.exception()  # failed by aclose/forget while the send still waited: seen
        if isinstance(answer, wire.Error):
            raise RemoteError(answer.code, answer.message)
        return answer

    async def send(self, msg: wire.Message, *, peer: bytes | None = None, corr: int = 0, flags: int = 0) -> None:
        """Send one message (to `peer` on a ROUTER), waiting for room if the queue is full,
        at most `options.send_timeout_s`. Raises PeerUnreachable if the ROUTER has no such
        peer, or if the peer did not take the message in that time (it stopped reading)."""
        try:
            await asyncio.wait_for(self._send(msg, peer, corr, flags), self.options.send_timeout_s)
        except TimeoutError:
            raise PeerUnreachable(
                f"{self.name}: peer {peer_name(peer)} took no message for {self.options.send_timeout_s:g}s "
                "(its queue is full: it stopped reading)"
            ) from None

    async def reply(self, env: Envelope, msg: wire.Message) -> None:
        """Answer the request `env` with `msg` (bounded as `send` is)."""
        await self.send(msg, peer=env.peer, corr=env.header.corr, flags=wire.Flag.REPLY)

    def forget(self, peer: bytes | None) -> None:
        """Stop tracking `peer` (it left); its pending requests fail as unreachable."""
        self.known_peers.discard(peer)
        self.last_seen.pop(peer, None)
        self._heard.discard(peer)
        for p, reply in self._pending.values():
            if p == peer and not reply.done():
                reply.set_exception(PeerUnreachable(f"{self.name}: peer {peer_name(peer)} was lost"))

    async def aclose(self) -> None:
        """Cancel the loops and handler tasks, fail pending requests, close the socket;
        logs the endpoint's counters (`channel_closed`)."""
        st = self.stats
        self.drop_log.summary()
        log.info("channel_closed", channel=self.name, sent=st.sent, received=st.received, dropped=dict(st.dropped))
        tasks = [*self._loops, *self._handlers]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)  # a handler deaf to cancellation must not hold the close
        for _, reply in self._pending.values():
            if not reply.done():
                reply.set_exception(ConnectionError(f"{self.name}: closed"))
        self.sock.close(linger=int(self.options.linger_s * 1000))

    # --- sending ------------------------------------------------------------------------

    async def _send(self, msg: wire.Message, peer: bytes | None, corr: int, flags: int) -> None:
        frames = self.frames(msg, peer, corr, flags)
        pause, longest = ROOM_POLL_S
        while True:
            try:
                await self.sock.send_multipart(frames, copy=False)
            except zmq.Again:
                # A ROUTER with this peer's queue full: the socket stays writable towards
                # other peers, so no event will say when this one drains. Look again.
                await asyncio.sleep(pause)
                pause = min(2 * pause, longest)
                continue
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    raise PeerUnreachable(f"{self.name}: peer {peer_name(peer)} is not connected") from None
                if self.sock.closed:
                    raise ConnectionError(f"{self.name}: closed") from None
                raise
            except asyncio.CancelledError:
                # Closing the socket cancels the sends still waiting for room: to their
                # callers (whose own task goes on) the endpoint closed.
                if self.sock.closed and not _cancelling():
                    raise ConnectionError(f"{self.name}: closed") from None
                raise
            self.sent(peer)
            return

    async def _greet(self, peer: bytes | None) -> None:
        """A heartbeat if it can leave at once: a full or dead peer queue must not stall
        the liveness checks."""
        frames = self.frames(wire.Heartbeat(sent_at=time.time()), peer)
        try:
            # DONTWAIT fails at once on a full queue, unless other sends already wait for
            # room, behind which zmq.asyncio queues it: bound that wait too.
            async with asyncio.timeout(self.options.heartbeat_s):
                await self.sock.send_multipart(frames, flags=zmq.DONTWAIT, copy=False)
        except (zmq.ZMQError, TimeoutError):
            return
        self.sent(peer)

    # --- receiving ----------------------------------------------------------------------

    async def _receive(self) -> None:
        """Admit and dispatch every message as it arrives, until the endpoint closes."""
        while True:
            try:
                frames = await self.sock.recv_multipart(copy=False)
            except zmq.ZMQError as exc:
                if self.sock.closed:
                    return
                # A socket error is no peer's message: the endpoint must outlive it.
                self.noisy.warning("recv_failed", channel=self.name, error=repr(exc))
                await asyncio.sleep(RECV_RETRY_S)
                continue
            env = self.admit(frames)
            if env is not None:
                self._dispatch(env)

    def _dispatch(self, env: Envelope) -> None:
        self._heard.add(env.peer)
        if env.peer is not None:
            self.known_peers.add(env.peer)
        if env.peer in self._lost:
            # Back after being reported lost: a later silence is reported again.
            self._lost.discard(env.peer)
            log.info("peer_back", channel=self.name, peer=peer_name(env.peer))
        if env.header.flags & wire.Flag.REPLY:
            self._resolve(env)
        elif self._handler is not None and not isinstance(env.msg, wire.Heartbeat):
            task = asyncio.create_task(self._handle(self._handler, env), name=f"{self.name}.{type(env.msg).__name__}")
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    def _resolve(self, env: Envelope) -> None:
        entry = self._pending.get(env.header.corr)
        if entry is None or entry[0] != env.peer or entry[1].done():
            self.stats.dropped["late_reply"] += 1
            return
        entry[1].set_result(env.msg)

    async def _handle(self, handler: Handler, env: Envelope) -> None:
        try:
            result = await handler(env)
        except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # torch's CheckpointException is a BaseException, and no less a failure
            self.noisy.warning("handler_failed", channel=self.name, msg=type(env.msg).__name__, error=repr(exc)[:2000])
            result = wire.Error(code=wire.ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}"[:20000])
        if result is None or not env.header.corr:
            return
        try:
            await self.reply(env, result)
        except PeerUnreachable as exc:
            self.noisy.warning("reply_unroutable", channel=self.name, error=str(exc))
        except Exception as exc:
            # An unencodable result must not leave the requester waiting for its timeout.
            self.noisy.warning("reply_failed", channel=self.name, msg=type(result).__name__, error=repr(exc))
            error = wire.Error(code=wire.ErrorCode.INTERNAL, message=f"reply not sent: {type(exc).__name__}: {exc}")
            try:
                await self.reply(env, error)
            except Exception as exc2:
                self.noisy.warning("reply_unroutable", channel=self.name, error=repr(exc2))

    # --- liveness -----------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.options.heartbeat_s)
            self.drop_log.tick()  # a flood that stopped is still summed up
            await self._check_peers(time.monotonic())

    async def _check_peers(self, now: float) -> None:
        """Report peers silent for longer than peer_timeout_s (once each), greet the quiet ones."""
        opts = self.options
        for peer in list(self.known_peers):
            seen = self.last_seen.get(peer, now)
            if now - seen > opts.peer_timeout_s and peer not in self._lost:
                self._lost.add(peer)
                # A server never heard from may not be up yet (a role registering while the
                # controller starts): reported to on_peer_lost all the same, but no warning.
                heard = peer in self._heard
                (log.warning if heard else log.info)(
                    "peer_silent", channel=self.name, peer=peer_name(peer), silent_s=round(now - seen, 2), heard=heard
                )
                await self._report_lost(peer)
            if now - self.last_sent.get(peer, 0.0) >= opts.heartbeat_s:
                await self._greet(peer)

    async def _report_lost(self, peer: bytes | None) -> None:
        if self.on_peer_lost is None:
            return
        try:
            result = self.on_peer_lost(peer)
            if asyncio.iscoroutine(result):
                await result
        except Exception as exc:
            log.warning("on_peer_lost_failed", channel=self.name, peer=peer_name(peer), error=repr(exc))

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        # Nobody awaits these tasks: without this an endpoint could stop serving in silence.
        if not task.cancelled() and task.exception() is not None:
            log.error("channel_loop_died", channel=self.name, loop=task.get_name(), error=repr(task.exception()))


def _cancelling() -> bool:
    """Whether the running task itself is being cancelled (not just a future it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
