"""Where an environment's code runs: a thread of its own per sample, never the rollout's event loop.

An environment is user code: its `reset` / `step` / `close` may block (a synchronous sleep,
a busy loop, a blocking socket) whether they are written `def` or `async def`. `EnvThread`
runs each call in a daemon thread that owns an event loop of its own, so the rollout's
loop (its heartbeats, the other samples, weight updates) keeps running whatever the call
does. What a caller may rely on:
* `await EnvThread.call(fn, timeout_s)` returns `fn()`'s result (awaited on the thread's
  loop when it is awaitable) or raises what it raised; past `timeout_s` it raises
  `TimeoutError`, whatever the call is doing. A call that cooperates is cancelled; one
  that blocks is abandoned: its thread is left to finish on its own (a daemon thread, it
  never holds the process open) and counted in `abandoned()`.
* `blocked` is true once a call has been abandoned (the thread may still be in it: a
  later call would queue behind it, so a caller runs such calls on a fresh `EnvThread`).
* `close()` stops the thread's loop once it is free; it never waits for a blocked call.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import threading
from collections.abc import Callable
from typing import Any

_abandoned = 0
_lock = threading.Lock()
_names = itertools.count()


def abandoned() -> int:
    """Environment threads left blocked past their timeout in this process so far."""
    return _abandoned


class EnvThread:
    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self.blocked = False
        self._thread = threading.Thread(target=self._run, name=f"tandem-env-{next(_names)}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def call(self, fn: Callable[[], Any], timeout_s: float) -> Any:
        """`fn()` on the thread (awaited there when awaitable), bounded by `timeout_s`."""
        future = asyncio.run_coroutine_threadsafe(_invoke(fn), self._loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except TimeoutError:
            future.cancel()
            self.blocked = True
            self._mark_abandoned()
            raise

    def _mark_abandoned(self) -> None:
        global _abandoned
        with _lock:
            _abandoned += 1

    def close(self) -> None:
        """Stop the loop once it is free (a blocked call keeps its thread until it returns)."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)


async def _invoke(fn: Callable[[], Any]) -> Any:
    result = fn()
    if inspect.isawaitable(result):
        result = await result
    return result
