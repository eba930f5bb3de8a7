"""The base every role process subclasses.

Lifecycle of `Role.main()` (one asyncio role per process, on uvloop):

    setup() → connect to the controller and register → log "ready" → run()

* SIGTERM / SIGINT only set a flag; the role then calls `drain()` (bounded by
  `shutdown_timeout_s`), `close()`, and exits 0. SIGUSR1 calls `preempt()`: the launcher
  sends it to the controller on a SIGTERM or SIGINT of its own, asking for a checkpoint
  before the run stops (roles/controller/role.py); any other role just stops.
* Before "ready" (a vLLM engine starting, a model loading) there is nothing to drain or
  save: SIGTERM / SIGINT end the process at once (exit 0, `stopped_before_ready` logged),
  rather than after the set-up it would otherwise finish, and it never logs "ready".
* A fatal error — an exception from `setup`/`run`, a named background task that dies,
  `fail(cause)`, or the controller falling silent — logs `fatal` with the cause, sends
  a `Dead` notice to the controller, closes, and exits 1.
* `run()` returning normally ends the role with exit code 0.
The process always ends through `os._exit`, so stray non-daemon threads (vLLM's, for
instance) can never keep a finished role alive.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import traceback
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import zmq
import zmq.asyncio

from runtime import gc_pauses
from runtime.config import RunConfig
from runtime.errors import TandemError, one_line
from runtime.identity import addresses
from runtime.identity.run_token import read_token
from runtime.last_words import MAX_CHARS, say
from runtime.logs import get_logger, on_write_error
from transport import wire
from transport.rpc import RemoteError, RpcEndpoint
from transport.sockets import connect_dealer

log = get_logger("role")


@dataclass
class RoleContext:
    """Everything a role process is told by its launcher."""

    cfg: RunConfig
    run_dir: Path
    role: str
    rank: int
    node: int = 0
    controller_address: str = ""
    env: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.rank}"


def _watch_parent(grace_s: float) -> None:
    """If the launcher dies, give this role `grace_s` to stop (it got SIGTERM), then kill
    its whole process group, children included: a role never outlives its launcher."""
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        time.sleep(grace_s)
        if os.getpgid(0) == os.getpid():  # our own group (the launcher made us a session leader)
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


class FatalError(TandemError, RuntimeError):
    """An error that ends the role; its message is the cause reported to peers."""


class Role:
    """Subclass and implement `setup`, `run` and optionally `drain` / `close`."""

    kind: ClassVar[str] = "role"
    registers: ClassVar[bool] = True

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.zmq = zmq.asyncio.Context()
        self.controller: RpcEndpoint | None = None
        self.registered: wire.Registered | None = None
        self._stop = asyncio.Event()
        self._fatal: str | None = None
        self._ready = False  # "ready" logged: a stop signal now drains rather than exits
        self._tasks: dict[str, asyncio.Task[Any]] = {}

    # --- to override ---------------------------------------------------------------
    async def setup(self) -> None:
        """Build engines and bind servers; runs before registration."""

    async def run(self) -> None:
        """The main loop; by default serve until stopped."""
        await self._stop.wait()

    async def drain(self) -> None:
        """Finish or abort in-flight work on a stop request (bounded by the caller)."""

    async def close(self) -> None:
        """Release engines and sockets (bounded by the caller)."""

    def on_registered(self, reply: wire.Registered) -> None:
        """Called once the controller accepted the registration, before any other message
        of this role is handled."""

    async def handle(self, env: Any) -> wire.Message | None:
        """Messages from the controller; return a reply or None. An override ends with
        `return self.unserved(msg)` for whatever it does not serve."""
        return self.unserved(env.msg)

    def unserved(self, msg: object) -> wire.Message | None:
        """The tail every role's `handle` shares: `Shutdown` stops the role (no reply), any
        other message is answered with a BAD_REQUEST error naming the role kind and the message type."""
        if isinstance(msg, wire.Shutdown):
            self.request_stop(msg.reason or "controller shutdown")
            return None
        return wire.Error(code=wire.ErrorCode.BAD_REQUEST, message=f"{self.kind} does not serve {type(msg).__name__}")

    def peer_info(self) -> wire.PeerInfo:
        """What this role tells the controller about itself."""
        return wire.PeerInfo(
            role=self.kind, rank=self.ctx.rank, node=self.ctx.node, capabilities={"host": socket.gethostname()}
        )

    # --- helpers for subclasses ----------------------------------------------------
    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `coro` as a named background task; if it raises, the role dies with it."""
        task = asyncio.create_task(coro, name=name)
        self._tasks[name] = task
        task.add_done_callback(self._task_done)
        return task

    def fail(self, cause: str) -> None:
        """End the role with a fatal error (idempotent: the first cause wins)."""
        if self._fatal is None:
            self._fatal = cause
        self._stop.set()

    def preempt(self) -> None:
        """SIGUSR1: the run is being stopped from outside (see the module docstring)."""
        self.request_stop("SIGUSR1")

    def _on_stop_signal(self, name: str) -> None:
        if self._ready:
            self.request_stop(name)
            return
        log.info("stopped_before_ready", signal=name)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # the launcher kills the process group's leftovers (an engine's workers)

    def request_stop(self, reason: str = "") -> None:
        if not self._stop.is_set():
            log.info("stop_requested", reason=reason)
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # --- lifecycle -----------------------------------------------------------------
    def main(self) -> None:
        """Run the role to completion and exit the process with its exit code."""
        import uvloop

        _watch_parent(grace_s=min(5.0, self.cfg.shutdown_timeout_s))
        try:
            code = uvloop.run(self._lifecycle())
        except BaseException as exc:
            cause = one_line(exc, MAX_CHARS)
            say(cause)  # first: the log may be what failed
            log.error("fatal", cause=cause)
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    async def _lifecycle(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal, signal.Signals(sig).name)
        loop.add_signal_handler(signal.SIGUSR1, self.preempt)
        on_write_error(lambda cause: loop.call_soon_threadsafe(self.fail, cause))  # a full disk ends the role
        try:
            self._start_auth()
            await self.setup()
            if self.registers:
                await self._register()
            frozen = gc_pauses.settle()  # set-up's objects live on: no collection walks them again
            gc_pauses.watch()
            await asyncio.sleep(0)  # a stop signal that came during a blocking set-up is handled first
            self._ready = True
            log.info("ready", pid=os.getpid(), gc_frozen=frozen)
            main = asyncio.create_task(self.run(), name="main")
            stop = asyncio.create_task(self._stop.wait(), name="stop-wait")
            await asyncio.wait({main, stop}, return_when=asyncio.FIRST_COMPLETED)
            if main.done() and main.exception() is not None:
                raise main.exception()  # type: ignore[misc]
            if not main.done() and self._fatal is None:
                await self._bounded(self.drain(), "drain")
            main.cancel()
            stop.cancel()
        except FatalError as exc:
            self.fail(str(exc))
        except Exception as exc:
            self.fail(one_line(exc, MAX_CHARS))
            log.error("traceback", text=traceback.format_exc()[-4000:])
        if self._fatal is not None:
            say(self._fatal)
            log.error("fatal", cause=self._fatal)
            await self._send_dead(self._fatal)
        await self._bounded(self._close_all(), "close")
        return 1 if self._fatal is not None else 0

    def _start_auth(self) -> None:
        """With CurveZMQ on, this process's servers accept only peers holding the run's Curve
        key (a ZAP handler checks it); without it they check the run token themselves
        (transport.zmtp_router)."""
        from transport.security import start_authenticator

        opts = addresses.channel_options(self.cfg, self.ctx.run_dir)
        if opts.curve is not None:
            self._auth = start_authenticator(self.zmq, opts.curve)

    async def _register(self) -> None:
        opts = addresses.channel_options(self.cfg, self.ctx.run_dir)
        self.controller = connect_dealer(
            self.zmq, self.ctx.controller_address, name="controller", identity=self.ctx.name, options=opts
        )
        self.controller.start(self.handle, on_peer_lost=self._controller_lost)
        register = wire.Register(peer=self.peer_info(), pid=os.getpid(), token=read_token(self.ctx.run_dir))
        try:
            reply = await self.controller.request(register, timeout=self.cfg.startup_timeout_s)
        except RemoteError as exc:
            raise FatalError(f"registration refused: {exc.message}") from None
        if not isinstance(reply, wire.Registered):
            raise FatalError(f"controller answered Register with {type(reply).__name__}")
        self.registered = reply
        self.on_registered(reply)

    def _controller_lost(self, _: bytes | None) -> None:
        # Before registration the controller may simply not be up yet (the Register
        # request has its own start-up timeout); only a registered controller can be lost.
        if self.registered is not None and not self.stopping:
            self.fail(f"controller silent for {self.cfg.transport.peer_timeout_s:g}s (lost)")

    async def _send_dead(self, cause: str) -> None:
        if self.controller is None:
            return
        try:
            await asyncio.wait_for(
                self.controller.send(wire.Dead(role=self.kind, rank=self.ctx.rank, cause=cause)), 1.0
            )
            await asyncio.sleep(0.05)  # let the frame leave before the socket closes
        except Exception:
            pass

    async def _close_all(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await self.close()
        if self.controller is not None:
            await self.controller.aclose()
        if getattr(self, "_auth", None) is not None:
            self._auth.stop()
        self.zmq.destroy(linger=200)

    async def _bounded(self, coro: Coroutine[Any, Any, Any], what: str) -> None:
        try:
            await asyncio.wait_for(coro, self.cfg.shutdown_timeout_s)
        except TimeoutError:
            log.warning("shutdown_step_timeout", step=what, timeout_s=self.cfg.shutdown_timeout_s)
        except Exception as exc:
            log.warning("shutdown_step_failed", step=what, error=repr(exc))

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.fail(f"task {task.get_name()} died: {one_line(exc, MAX_CHARS)}")
