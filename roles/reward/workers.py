"""User reward functions run in worker processes, never in the reward role's own.

A caller may rely on:
* `WorkerPool.call(spec, kwargs, timeout_s)` runs function `spec` in an idle worker
  process (started on demand, at most `size` at once) and returns its result as a finite
  float, or raises `RewardCallError` saying why not, with a `reason` (`REASONS`): it
  raised, returned something that is not a number (numpy scalars and 0-d arrays are
  numbers), returned NaN or an infinity, did not answer within `timeout_s`, or its
  worker died. A worker that overran its timeout is killed and replaced: no process or
  thread outlives its call's timeout, and a function that holds the GIL (catastrophic
  regex backtracking) or blocks an event loop (`time.sleep` in an `async def`) costs only
  its own worker, never the role.
* Arguments and results cross the pipe as msgpack (msgspec), never pickle. Workers are
  fresh interpreters (`python -m roles.reward.workers`: not forked from the role, which
  holds ZeroMQ's threads, and not `multiprocessing` spawn, which would re-import the
  role's own entry point and torch in every worker) that import only the reward
  functions: one starts in about 0.1 s, plus what the functions' modules import.
* `await WorkerPool.start()` starts all `size` workers up front, so no request waits for
  a worker's start. A start (the interpreter, then importing the functions' modules, and
  with them every import at a module's top level) is bounded by `STARTUP_TIMEOUT_S` and
  never counted in a call's `timeout_s`; a worker that fails to start raises
  `RewardCallError` (reason `worker_died`) saying whether it exited (and with which code)
  or did not answer in time, never a call's timeout.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import os
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from runtime.errors import TandemError, one_line
from runtime.logs import get_logger

log = get_logger("reward")
STARTUP_TIMEOUT_S = 120.0  # a worker's start (spawn, importing the functions)


# Why a call gave no reward: the `reason` of a RewardCallError, counted per function.
REASONS = ("raised", "not_a_number", "nonfinite", "out_of_range", "timeout", "worker_died")


class RewardCallError(TandemError, RuntimeError):
    """A call that gave no reward; the message names the function and why, `reason` is
    one of `REASONS`."""

    def __init__(self, message: str, reason: str = "raised") -> None:
        super().__init__(message)
        self.reason = reason


def as_reward(value: Any) -> float:
    """`value` as a finite float; a RewardCallError (reason `not_a_number` or `nonfinite`)
    otherwise. Python and numpy numbers count, and 0-d arrays and tensors of one (`.item()`),
    bools do not (a reward function returning True is a bug, not a score of 1)."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardCallError(f"returned {type(value).__name__} {value!r:.80}, not a number", "not_a_number")
    number = float(value)
    if not math.isfinite(number):
        raise RewardCallError(f"returned {number}, not a finite number", "nonfinite")
    return number


def _serve(inbox: Connection, conn: Connection, specs: list[str]) -> None:
    """A worker's loop: [spec, kwargs] in, [ok, value or error text, reason] out, until EOF."""
    import inspect

    from runtime.user_functions import load_function

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the role stops us, not a Ctrl-C to the group
    functions = {spec: load_function(spec) for spec in specs}
    conn.send_bytes(b"ready")
    while True:
        try:
            spec, kwargs = msgspec.msgpack.decode(inbox.recv_bytes())
        except EOFError:
            return
        try:
            fn = functions[spec]
            value = asyncio.run(fn(**kwargs)) if inspect.iscoroutinefunction(fn) else fn(**kwargs)
            reply: list[Any] = [True, as_reward(value), ""]
        except RewardCallError as exc:
            reply = [False, str(exc)[:500], exc.reason]
        except BaseException as exc:  # a user function's failure is the call's result
            reply = [False, one_line(exc), "raised"]
        conn.send_bytes(msgspec.msgpack.encode(reply))


class _Worker:
    def __init__(self, specs: list[str]) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        cmd = [sys.executable, "-m", "roles.reward.workers", str(to_child_r), str(from_child_w), *specs]
        self.proc = subprocess.Popen(cmd, pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(from_child_w)
        self._out = Connection(to_child_w, readable=False)
        self.conn = Connection(from_child_r, writable=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send_bytes(self, data: bytes) -> None:
        self._out.send_bytes(data)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._out.close()
        self.conn.close()


async def _readable(conn: Connection) -> None:
    """Until `conn` has something to read, without blocking the event loop."""
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()
    loop.add_reader(conn.fileno(), ready.set)
    try:
        await ready.wait()
    finally:
        loop.remove_reader(conn.fileno())


class WorkerPool:
    def __init__(self, specs: list[str], size: int) -> None:
        self.specs = specs
        self.size = size
        self._idle: list[_Worker] = []
        self._slots = asyncio.Semaphore(size)
        self._starting: set[asyncio.Task[None]] = set()
        self.killed = 0
        self._closed = False

    async def start(self) -> None:
        """Start workers until `size` are idle, as many at once as there are CPUs (each is
        bounded by `STARTUP_TIMEOUT_S` from its own spawn: sixteen importing sympy or
        reasoning-gym at once on 2 cores would each take the time of all); a worker that
        fails to start raises `RewardCallError`."""
        missing = self.size - len(self._idle)
        at_once = asyncio.Semaphore(max(1, os.cpu_count() or 1))

        async def one() -> _Worker:
            async with at_once:
                return await self._start()

        self._idle.extend(await asyncio.gather(*[one() for _ in range(missing)]))

    async def call(self, spec: str, kwargs: dict[str, Any], timeout_s: float) -> float:
        async with self._slots:
            worker = self._idle.pop() if self._idle else await self._start()
            try:
                ok, value, reason = await asyncio.wait_for(self._ask(worker, spec, kwargs), timeout_s)
            except TimeoutError:
                self._discard(worker)
                raise RewardCallError(
                    f"{spec} timed out after {timeout_s:g}s (its worker was killed)", "timeout"
                ) from None
            except (EOFError, OSError) as exc:
                self._discard(worker)
                raise RewardCallError(f"{spec}: its worker died ({type(exc).__name__})", "worker_died") from None
            self._idle.append(worker)
        if not ok:
            raise RewardCallError(f"{spec} {value}", reason)
        return float(value)

    async def _start(self) -> _Worker:
        """A new worker, once it has imported the functions (not counted in any call's timeout)."""
        worker = _Worker(self.specs)
        try:
            await asyncio.wait_for(_readable(worker.conn), STARTUP_TIMEOUT_S)
            if worker.conn.recv_bytes() != b"ready":
                raise EOFError
        except TimeoutError:
            worker.kill()
            raise RewardCallError(
                f"a reward worker did not start in {STARTUP_TIMEOUT_S:g}s (importing {', '.join(self.specs)})",
                "worker_died",
            ) from None
        except (EOFError, OSError):
            try:
                code: int | str = worker.proc.wait(5)  # its pipe closed as it exits
            except subprocess.TimeoutExpired:
                code = "none yet"
            worker.kill()
            raise RewardCallError(
                f"a reward worker exited while starting (exit code {code}; its error is in the reward role's log)",
                "worker_died",
            ) from None
        return worker

    async def _ask(self, worker: _Worker, spec: str, kwargs: dict[str, Any]) -> list[Any]:
        """Send the call and wait for the answer without blocking the event loop."""
        worker.send_bytes(msgspec.msgpack.encode([spec, kwargs]))
        await _readable(worker.conn)
        return msgspec.msgpack.decode(worker.conn.recv_bytes())  # type: ignore[no-any-return]

    def _discard(self, worker: _Worker) -> None:
        """Kill `worker` and start its replacement in the background."""
        self.killed += 1
        worker.kill()
        task = asyncio.ensure_future(self._replace())
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _replace(self) -> None:
        try:
            self._idle.append(await self._start())
        except RewardCallError as exc:
            if not self._closed:  # a worker killed with the role is no news
                log.warning("reward_worker_not_replaced", error=str(exc))

    def pids(self) -> list[int]:
        """The idle workers' process ids."""
        return [w.pid for w in self._idle]

    async def settled(self) -> None:
        """Until no replacement is starting."""
        while self._starting:
            await asyncio.gather(*self._starting, return_exceptions=True)

    def close(self) -> None:
        self._closed = True
        for task in self._starting:
            task.cancel()
        for worker in self._idle:
            worker.kill()
        self._idle.clear()


if __name__ == "__main__":  # a worker: python -m roles.reward.workers IN_FD OUT_FD SPEC...
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False), sys.argv[3:])
