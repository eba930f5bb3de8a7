"""A thin wrapper over vLLM's `AsyncLLM` for RL rollouts.

What a caller may rely on:
* `generate` returns one sample with its token ids, the logprob of every sampled token
  (the behaviour policy's, as vLLM computed it) and the policy version that produced
  every token. Versions come from vLLM's own per-step weight-version labels where the
  vLLM build has them (0.32+): the label is set while the engine is paused, so each
  token is attributed to the weights of the step that sampled it. Older builds fall
  back to marking the token count of every in-flight request at resume time.
* `apply_weights` pauses scheduling with in-flight requests kept, loads a staged
  version in place, switches the prefix-cache salt to the new version (no KV computed
  by older weights is reused for new requests), and resumes. Versions only go up.
  `receive_weights` does the same with a version the workers receive by broadcast.
* Bad requests (prompt too long, bad sampling values) come back as samples with
  `finish_reason=ERROR` and a one-line `error`; they never disturb other requests.
  A dead engine raises `EngineDead` from every call.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from runtime.config import EngineConfig
from runtime.logs import get_logger
from transport.wire import FinishReason, SamplingSpec, WeightCollectivePlan

log = get_logger("rollout")
WORKER_EXTENSION = "roles.rollout.worker_ext.TandemWorkerExtension"
_FINISH = {"length": FinishReason.LENGTH, "stop": FinishReason.STOP, "abort": FinishReason.ABORT}


class EngineDead(RuntimeError):
    """vLLM's engine died; the message carries its error."""


class StaleUpdate(ValueError):
    """A weight update for an older version than the engine's."""


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    prompt_len: int
    gen_s: float
    error: str = ""


@dataclass
class _Active:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    marks: list[tuple[int, int]] = field(default_factory=list)


class RolloutEngine:
    """One `AsyncLLM` engine plus version bookkeeping; create, then `await start()`."""

    def __init__(self, cfg: EngineConfig, model_path: str, *, version: int = 0, prefix_salt: bool = True) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.version = version
        self.prefix_salt = prefix_salt and cfg.enable_prefix_caching
        self.engine: Any = None
        self.native_versions = False
        self._active: dict[str, _Active] = {}
        self._update_lock = asyncio.Lock()
        self.tokens_generated = 0
        self.scheduler_stats: Any = None

    async def start(self) -> None:
        if not os.path.isdir(self.model_path):
            raise FileNotFoundError(f"model.path '{self.model_path}' is not a directory")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.cfg.cpu_kvcache_gb))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=self.model_path,
            skip_tokenizer_init=True,
            dtype=self.cfg.dtype,
            max_model_len=self.cfg.max_model_len,
            gpu_memory_utilization=self.cfg.gpu_memory_utilization,
            tensor_parallel_size=self.cfg.tensor_parallel_size,
            enforce_eager=self.cfg.enforce_eager,
            seed=self.cfg.seed,
            max_num_seqs=self.cfg.max_num_seqs,
            enable_prefix_caching=self.cfg.enable_prefix_caching,
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=False,
        )
        self.engine = AsyncLLM.from_engine_args(args, stat_loggers=[_stats_factory(self)])
        core = self.engine.engine_core
        self.native_versions = hasattr(core, "set_weight_version_async")
        if self.native_versions:
            await core.set_weight_version_async(str(self.version))

    @property
    def num_active(self) -> int:
        return len(self._active)

    async def generate(self, request_id: str, prompt_ids: list[int], spec: SamplingSpec, index: int = 0) -> Sample:
        """One completion of `prompt_ids` (sample `index` of request `request_id`)."""
        self._check_alive()
        started = time.perf_counter()
        vid = f"{request_id}#{index}"
        state = _Active(marks=[(0, self.version)])
        try:
            params = _sampling_params(spec, index, stream=not self.native_versions)
            prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_ids)}
            if self.prefix_salt:
                prompt["cache_salt"] = f"v{self.version}"
            last = await self._run(vid, prompt, params, state)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # vLLM raises several types for bad requests
            self._check_alive(exc)
            prefix = "bad sampling params: " if isinstance(exc, _BadParams) else ""
            return _error_sample(prompt_ids, started, prefix + _one_line(exc.__cause__ or exc), state)
        finally:
            self._active.pop(vid, None)
        return self._finish(state, last, len(prompt_ids), started)

    async def _run(self, vid: str, prompt: dict[str, Any], params: Any, state: _Active) -> Any:
        """Add the request, then collect its outputs. The sample counts as active (and
        `abort_all` reaches it) once vLLM knows it."""
        queue = await self.engine.add_request(vid, prompt, params)
        self._active[vid] = state
        last = None
        try:
            while last is None or not last.finished:
                last = queue.get_nowait() or await queue.get()
                self._take(state, last.outputs[0])
        except asyncio.CancelledError:
            await self.engine.abort(vid)
            raise
        return last

    def _take(self, state: _Active, comp: Any) -> None:
        new = list(comp.token_ids)
        state.tokens.extend(new)
        for tok, entry in zip(new, comp.logprobs or [], strict=False):
            state.logprobs.append(float(entry[tok].logprob))
        self.tokens_generated += len(new)

    def _finish(self, state: _Active, last: Any, prompt_len: int, started: float) -> Sample:
        comp = last.outputs[0] if last is not None else None
        reason = _FINISH.get(getattr(comp, "finish_reason", None) or "abort", FinishReason.STOP)
        versions = _versions(len(state.tokens), state.marks)
        spans = getattr(comp, "weight_versions", None)
        if self.native_versions and spans:
            versions = _versions_from_spans(len(state.tokens), spans, versions)
        return Sample(state.tokens, state.logprobs, versions, reason, prompt_len, time.perf_counter() - started)

    async def abort_all(self) -> int:
        """Abort every active sample; each returns with its tokens so far. Returns how many."""
        vids = list(self._active)
        if vids:
            await self.engine.abort(vids)
        return len(vids)

    async def apply_weights(self, version: int, manifest: dict[str, Any], timeout_s: float) -> dict[str, float]:
        """Pause (keeping requests), load the staged `version`, resume. Returns phase times."""
        return await self._update(version, "tandem_load_weights", manifest, timeout_s)

    async def receive_weights(self, plan: WeightCollectivePlan, timeout_s: float) -> dict[str, float]:
        """As `apply_weights`, but the workers receive `plan.version` over their weight
        group (see `init_weight_group`) as the trainer broadcasts it. `timeout_s` bounds
        each bucket; the call is bounded by one more `timeout_s` than there are buckets."""
        bound = timeout_s * (len(plan.bucket_sizes) + 1)
        return await self._update(plan.version, "tandem_receive_broadcast", msgspec.to_builtins(plan), bound)

    async def init_weight_group(self, spec: dict[str, Any], timeout_s: float) -> list[Any]:
        """Every worker joins the trainer's weight group (generation goes on meanwhile)."""
        self._check_alive()
        return await asyncio.wait_for(  # type: ignore[no-any-return]
            self.engine.collective_rpc("tandem_init_weight_group", args=(spec,)), timeout_s
        )

    async def close_weight_group(self, timeout_s: float) -> None:
        """Every worker leaves its weight group, so a trainer still sending fails at once."""
        await asyncio.wait_for(self.engine.collective_rpc("tandem_close_weight_group"), timeout_s)

    async def _update(self, version: int, method: str, payload: Any, timeout_s: float) -> dict[str, float]:
        """Pause (keeping requests), run the worker load `method`, switch version, resume."""
        async with self._update_lock:
            if version < self.version:
                raise StaleUpdate(f"update to version {version} refused: rollout is at version {self.version}")
            self._check_alive()
            t0 = time.perf_counter()
            await self.engine.pause_generation(mode="keep", clear_cache=False)
            t_paused = time.perf_counter()
            try:
                results = await asyncio.wait_for(self.engine.collective_rpc(method, args=(payload,)), timeout_s)
                self._switch_version(version)
                if self.native_versions:
                    await self.engine.engine_core.set_weight_version_async(str(version))
            finally:
                await self.engine.resume_generation()
            if not self._active:
                await self.engine.reset_prefix_cache()
            total = time.perf_counter() - t0
            return {
                "pause_s": t_paused - t0,
                "receive_s": max(r.get("receive_s", 0.0) for r in results),
                "load_s": max(r["load_s"] for r in results),
                "total_s": total,
            }

    def _switch_version(self, version: int) -> None:
        self.version = version
        for state in self._active.values():
            state.marks.append((len(state.tokens), version))

    async def checksum(self) -> float:
        results = await self.engine.collective_rpc("tandem_checksum")
        return float(results[0])

    def _check_alive(self, cause: BaseException | None = None) -> None:
        if self.engine is not None and self.engine.errored:
            raise EngineDead(f"vLLM engine died: {_one_line(cause or self.engine.dead_error)}")

    def stats(self) -> dict[str, Any]:
        s = self.scheduler_stats
        return {
            "running": getattr(s, "num_running_reqs", len(self._active)),
            "waiting": getattr(s, "num_waiting_reqs", 0),
            "kv_cache_usage": round(float(getattr(s, "kv_cache_usage", 0.0)), 4),
        }

    async def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


class _BadParams(ValueError):
    pass


def _sampling_params(spec: SamplingSpec, index: int, *, stream: bool) -> Any:
    """vLLM params for one sample. `stream`: deltas every step (needed to mark versions by
    token count when vLLM has no per-step version labels); else the final output only."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    try:
        return SamplingParams(
            n=1,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k if spec.top_k > 0 else -1,
            max_tokens=spec.max_tokens,
            stop_token_ids=list(spec.stop_token_ids),
            ignore_eos=spec.ignore_eos,
            seed=None if spec.seed is None else spec.seed + index,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        )
    except Exception as exc:  # vLLM validates with several exception types
        raise _BadParams(str(exc)) from exc


def _versions(n: int, marks: list[tuple[int, int]]) -> list[int]:
    out = [0] * n
    for start, version in marks:
        for i in range(start, n):
            out[i] = version
    return out


def _versions_from_spans(n: int, spans: list[Any], fallback: list[int]) -> list[int]:
    out = list(fallback)
    for span in spans:
        for i in range(max(0, span.start), min(n, span.end)):
            out[i] = int(span.version)
    return out


def _error_sample(prompt_ids: list[int], started: float, error: str, state: _Active | None = None) -> Sample:
    state = state or _Active()
    n = len(state.tokens)
    versions = _versions(n, state.marks)
    return Sample(
        state.tokens,
        state.logprobs[:n],
        versions,
        FinishReason.ERROR,
        len(prompt_ids),
        time.perf_counter() - started,
        error,
    )


def _one_line(exc: BaseException | None) -> str:
    text = f"{type(exc).__name__}: {exc}" if exc is not None else "unknown error"
    return " ".join(text.split())[:500]


def _stats_factory(owner: RolloutEngine) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class TandemStats(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
        ) -> None:
            if scheduler_stats is not None:
                owner.scheduler_stats = scheduler_stats

        def log_engine_initialized(self) -> None:
            pass

    return TandemStats
