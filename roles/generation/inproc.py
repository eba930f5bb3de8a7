"""vLLM's engine core in the rollout's own process, stepped by one thread, as vLLM's offline
`LLM.generate` runs it with `VLLM_ENABLE_V1_MULTIPROCESSING=0`: no engine-core process
between the role and the model, and one output per request (FINAL_ONLY) instead of one
message per token. On one H200 that drive generated the 1.54B bench batch in 2.48 s where
`AsyncLLM` (engine core in its own process, per-token outputs) took 3.6 s.

What a caller (roles/generation/engine.py) may rely on:
* Every call into vLLM runs on the engine thread, between two engine steps, in the order
  the calls were made; the asyncio side awaits its result (`call`). The caller bounds the
  wait; a call that never returns leaves the thread stuck, which the stall watchdog sees.
* `add_request` returns a future that resolves with the request's `Finished` (all its
  tokens and their logprobs) once vLLM finishes it, or with the error vLLM raised for it
  (a prompt too long, bad sampling values): one request's error never touches another.
* `pause_generation` stops scheduling with the requests kept and returns once no step is
  in flight (async scheduling's queued batch included): token counts read while paused
  (`output_counts`) are exact, and weights loaded while paused are used by the steps after
  `resume_generation` only.
* `abort(ids)`: each aborted request resolves with the tokens it has so far and
  finish_reason "abort".
* A step that raises, or a worker process of vLLM's that dies (tensor-parallel or CPU
  engines run their workers as processes), kills the engine: `errored` turns true,
  `dead_error` holds the cause, and every pending request and later call raises
  `EngineDeadError`.
* `steps` counts engine steps and `last_step_at` is when the last one ended (monotonic);
  `stats` holds the scheduler's running and waiting requests and KV-cache use, refreshed
  about once a second while it steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from roles.generation.errors import EngineDeadError

T = TypeVar("T")
STATS_EVERY_S = 1.0
_STOP = object()


@dataclass
class Finished:
    """A request's outcome: every token it sampled and that token's logprob."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # vLLM's: "length", "stop", "abort"
    routed_experts: Any = None  # numpy [N, layers, top_k]: an engine started to report MoE routing


class InprocEngine:
    """vLLM's `LLMEngine` with its engine core in this process; `await start()`, then call."""

    def __init__(self, engine_args: dict[str, Any], *, name: str = "vllm-engine") -> None:
        self._args = engine_args
        self._name = name
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: dict[str, asyncio.Future[Finished]] = {}  # by request id (loop thread)
        self._internal: dict[str, str] = {}  # request id -> vLLM's internal id (engine thread)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._llm: Any = None
        self._paused = False
        self.errored = False
        self.dead_error: BaseException | None = None
        self.steps = 0
        self.last_step_at = time.monotonic()
        self.stats: dict[str, Any] = {}
        self._stats_at = 0.0

    # --- the asyncio side ------------------------------------------------------------
    async def start(self) -> None:
        """Build the engine on its thread (minutes on a cold GPU); raise what vLLM raised."""
        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = self._loop.create_future()
        self._thread = threading.Thread(target=self._main, args=(ready,), name=self._name, daemon=True)
        self._thread.start()
        await ready

    async def call(self, fn: Callable[[Any], T]) -> T:
        """`fn(llm_engine)` on the engine thread, between two steps."""
        self._check_alive()
        done: asyncio.Future[T] = self._loop_or_fail().create_future()
        self._commands.put((fn, done))
        return await done

    def add_request(self, request_id: str, prompt: dict[str, Any], params: Any, lora_request: Any = None) -> Any:
        """Queue one request (n=1); the future resolves with its `Finished`."""
        self._check_alive()
        done: asyncio.Future[Finished] = self._loop_or_fail().create_future()
        self._pending[request_id] = done

        def add(llm: Any) -> None:
            try:
                self._internal[request_id] = llm.add_request(request_id, prompt, params, lora_request=lora_request)
            except Exception as exc:  # a bad request fails alone
                self._post(self._set, request_id, exc)

        self._commands.put((add, None))
        return done

    async def abort(self, request_ids: str | list[str]) -> None:
        """Abort requests; each resolves with its tokens so far (finish_reason "abort")."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        await self.call(lambda llm: self._abort(llm, ids))

    async def pause_generation(self) -> None:
        await self.call(self._pause)

    async def resume_generation(self) -> None:
        await self.call(self._resume)

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return await self.call(lambda llm: llm.collective_rpc(method, args=args))  # type: ignore[no-any-return]

    async def sleep(self, level: int) -> None:
        await self.call(lambda llm: llm.sleep(level=level))

    async def wake_up(self, tags: list[str]) -> None:
        await self.call(lambda llm: llm.wake_up(tags=tags))

    async def reset_prefix_cache(self) -> None:
        await self.call(lambda llm: llm.reset_prefix_cache())

    async def output_counts(self, request_ids: list[str]) -> dict[str, int]:
        """Tokens each request has sampled so far (exact while paused)."""
        return await self.call(lambda llm: {r: self._count(llm, r) for r in request_ids})

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop stepping and shut vLLM down (its memory, its worker processes); idempotent."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._commands.put(_STOP)
        thread.join(timeout_s)
        self._fail_pending(EngineDeadError("vLLM engine shut down"))

    def _loop_or_fail(self) -> asyncio.AbstractEventLoop:
        if self._loop is None or self._thread is None:
            raise EngineDeadError("vLLM engine is not running")
        return self._loop

    def _check_alive(self) -> None:
        if self.errored:
            raise EngineDeadError(f"vLLM engine died: {self.dead_error}")

    def _deliver(self, outputs: list[Any]) -> None:
        """Resolve finished requests (loop thread: the conversion is off the engine's path)."""
        for out in outputs:
            comp = out.outputs[0]
            tokens = list(comp.token_ids)
            logprobs = [float(entry[tok].logprob) for tok, entry in zip(tokens, comp.logprobs or [], strict=False)]
            routed = getattr(comp, "routed_experts", None)
            self._set(out.request_id, Finished(tokens, logprobs, comp.finish_reason or "stop", routed))

    def _set(self, request_id: str, result: Finished | BaseException) -> None:
        done = self._pending.pop(request_id, None)
        if done is None or done.done():
            return
        if isinstance(result, BaseException):
            done.set_exception(result)
        else:
            done.set_result(result)

    def _fail_pending(self, exc: BaseException) -> None:
        for request_id in list(self._pending):
            self._set(request_id, exc)

    # --- the engine thread -------------------------------------------------------------
    def _main(self, ready: asyncio.Future[None]) -> None:
        try:
            self._llm = self._build()
        except BaseException as exc:
            self._post(_settle, ready, exc)
            return
        self._llm.engine_core.engine_core.model_executor.register_failure_callback(self._workers_died)
        self._post(_settle, ready, None)
        try:
            self._run()
        except BaseException as exc:  # a step or a command raised outside any one call
            self.dead_error, self.errored = exc, True
            self._post(self._fail_pending, EngineDeadError(f"vLLM engine died: {exc}"))
        finally:
            with contextlib.suppress(Exception):
                self._llm.engine_core.shutdown()

    def _workers_died(self) -> None:
        """vLLM's executor saw a worker process die (its monitor thread calls this)."""
        self.dead_error, self.errored = RuntimeError("a vLLM worker process died"), True
        self._post(self._fail_pending, EngineDeadError("vLLM engine died: a vLLM worker process died"))

    def _build(self) -> Any:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor.abstract import Executor

        config = EngineArgs(**self._args).create_engine_config(UsageContext.LLM_CLASS)  # LLM.generate's batch defaults
        return LLMEngine(
            vllm_config=config,
            executor_class=Executor.get_class(config),
            log_stats=not self._args.get("disable_log_stats", True),
            multiprocess_mode=False,  # the engine core here, whatever VLLM_ENABLE_V1_MULTIPROCESSING says
        )

    def _run(self) -> None:
        llm = self._llm
        while True:
            busy = not self._paused and llm.has_unfinished_requests()
            if not self._commands_done(block=not busy):
                return
            if self._paused or not llm.has_unfinished_requests():
                continue
            self._step(llm)

    def _commands_done(self, *, block: bool) -> bool:
        """Run the queued commands (waiting for one when `block`); False at shutdown."""
        while True:
            try:
                item = self._commands.get(block=block, timeout=1.0 if block else None)
            except queue.Empty:
                return True
            if item is _STOP:
                return False
            block = False
            fn, done = item
            try:
                result = fn(self._llm)
            except Exception as exc:
                if done is not None:
                    self._post(_settle, done, exc)
                continue
            if done is not None:
                self._post(_settle, done, None, result)

    def _step(self, llm: Any) -> None:
        outputs = llm.step()
        self.steps += 1
        self.last_step_at = now = time.monotonic()
        finished = [o for o in outputs if o.finished]
        if finished:
            self._post(self._deliver, finished)
        if now - self._stats_at >= STATS_EVERY_S:
            self._stats_at = now
            self.stats = _scheduler_stats(llm)

    def _pause(self, llm: Any) -> None:
        """Stop scheduling (requests kept), then finish the batches already queued."""
        core = llm.engine_core.engine_core
        core.pause_scheduler(mode="keep", clear_cache=False)
        self._paused = True
        for _ in range(16):  # async scheduling keeps at most a couple of batches queued
            if not getattr(core, "batch_queue", None):
                break
            self._step(llm)

    def _resume(self, llm: Any) -> None:
        llm.engine_core.engine_core.resume_scheduler()
        self._paused = False

    def _abort(self, llm: Any, request_ids: list[str]) -> None:
        internal = {r: self._internal.pop(r) for r in request_ids if r in self._internal}
        partial = {r: _so_far(llm, i) for r, i in internal.items()}
        if internal:
            llm.abort_request(list(internal.values()), internal=True)
        for request_id, result in partial.items():
            self._post(self._set, request_id, result)

    def _count(self, llm: Any, request_id: str) -> int:
        state = llm.output_processor.request_states.get(self._internal.get(request_id, ""))
        return 0 if state is None else int(state.detokenizer.num_output_tokens())

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            self._loop.call_soon_threadsafe(fn, *args)


def _settle(done: asyncio.Future[Any], exc: BaseException | None, result: Any = None) -> None:
    if done.done():
        return
    if exc is not None:
        done.set_exception(exc)
    else:
        done.set_result(result)


def _so_far(llm: Any, internal_id: str) -> Finished:
    """The tokens and logprobs a request has so far (vLLM's output state for it)."""
    state = llm.output_processor.request_states.get(internal_id)
    if state is None:
        return Finished([], [], "abort")
    tokens = list(state.detokenizer.output_token_ids)
    entries = state.logprobs_processor.logprobs or []
    logprobs = [float(entry[tok].logprob) for tok, entry in zip(tokens, entries, strict=False)]
    return Finished(tokens, logprobs, "abort")


def _scheduler_stats(llm: Any) -> dict[str, Any]:
    """Running and waiting requests and KV-cache use, read off vLLM's scheduler."""
    try:
        sched = llm.engine_core.engine_core.scheduler
        kv = getattr(getattr(sched, "kv_cache_manager", None), "usage", 0.0)
        return {"running": len(sched.running), "waiting": len(sched.waiting), "kv_cache_usage": round(float(kv), 4)}
    except Exception:  # another scheduler: the numbers are a view, not a step
        return {}
