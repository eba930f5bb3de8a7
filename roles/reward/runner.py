"""Runs reward functions named `module:function` with bounded concurrency and a timeout.

A call that raises or does not return within the timeout scores 0.0; the failure is
logged with the exception and counted, and the run goes on. Sync functions run in a
daemon thread of their own, so a function that never returns only strands its thread
(counted in `abandoned`), never the event loop or other calls.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import threading
from collections.abc import Callable
from typing import Any

from runtime.logs import get_logger

log = get_logger("reward")
ARGUMENTS = ("prompt", "completion", "answer", "metadata", "prompt_ids", "completion_ids")


def load_function(spec: str) -> Callable[..., Any]:
    """Import `module:function`; a one-line error names the part that failed."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward function '{spec}': cannot import '{module_name}' ({exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function '{spec}': '{attr}' is not a callable in {module_name}")
    return fn  # type: ignore[no-any-return]


class RewardRunner:
    def __init__(self, specs: list[str], *, timeout_s: float, concurrency: int) -> None:
        self.functions = [(spec, load_function(spec)) for spec in specs]
        self.timeout_s = timeout_s
        self.slots = asyncio.Semaphore(concurrency)
        self.failures = 0
        self.abandoned = 0

    async def score(self, item: dict[str, Any]) -> tuple[float, str]:
        """Sum of every function's reward for one sample, and the first error (or "")."""
        total, first_error = 0.0, ""
        for spec, fn in self.functions:
            value, error = await self._call(spec, fn, item)
            total += value
            first_error = first_error or error
        return total, first_error

    async def _call(self, spec: str, fn: Callable[..., Any], item: dict[str, Any]) -> tuple[float, str]:
        kwargs = _accepted(fn, item)
        async with self.slots:
            try:
                if inspect.iscoroutinefunction(fn):
                    value = await asyncio.wait_for(fn(**kwargs), self.timeout_s)
                else:
                    value = await asyncio.wait_for(_in_thread(fn, kwargs), self.timeout_s)
                return float(value), ""
            except TimeoutError:
                self.failures += 1
                if not inspect.iscoroutinefunction(fn):
                    self.abandoned += 1
                error = f"{spec} timed out after {self.timeout_s:g}s"
            except Exception as exc:
                self.failures += 1
                error = f"{spec} raised {type(exc).__name__}: {exc}"
        log.warning("reward_call_failed", error=error[:500], failures=self.failures)
        return 0.0, error


def _accepted(fn: Callable[..., Any], item: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {k: item[k] for k in ARGUMENTS}
    return {k: item[k] for k in ARGUMENTS if k in params}


def _in_thread(fn: Callable[..., Any], kwargs: dict[str, Any]) -> asyncio.Future[Any]:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def target() -> None:
        try:
            result = fn(**kwargs)
        except BaseException as exc:
            loop.call_soon_threadsafe(settle, False, exc)
        else:
            loop.call_soon_threadsafe(settle, True, result)

    threading.Thread(target=target, daemon=True, name="reward-call").start()
    return fut
