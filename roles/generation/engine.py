"""The rollout's vLLM engine for RL rollouts: vLLM's engine core in this process, stepped
by one thread (roles/generation/inproc.py), as vLLM's offline `LLM.generate` drives it.

What a caller may rely on:
* `generate` returns one sample with its token ids, the logprob of every sampled token
  (the behaviour policy's, as vLLM computed it) and the policy version that produced
  every token. An update switches versions while the engine is paused with no step in
  flight, and marks the token count of every request in flight at that moment, so each
  token is attributed to the weights of the step that sampled it.
* An update is `begin_update` (pause scheduling with in-flight requests kept), one
  `load_bucket` per bucket (staged in shared memory, a CUDA IPC buffer, or a broadcast),
  then `finish_update`: switch the version and the prefix-cache salt (no KV computed by
  older weights is reused for new requests) and resume; `abandon_update` resumes
  without switching. Versions only go up. Every engine call is bounded by a timeout.
* With `lora` (a `LoraServing`), vLLM serves LoRA adapters and an update is an adapter:
  it is registered while generation goes on (no pause), requests dispatched after it run
  on it, and requests in flight finish on the adapter they started with, so every token
  of a sample has the version its request started at. Versions are adapter ids - 1.
* With `sleep_mode`, `sleep` frees the KV cache and moves the weights to host memory
  (vLLM level 1) or discards them (level 2: the caller promises that the next update
  replaces every weight); an update wakes the weights, a generate request whatever still
  sleeps. Nothing is ever sampled from discarded weights: a request that comes before an
  update has reloaded them waits for one (`reload_wait_s`), then fails as `EngineDeadError`.
* An engine call that runs out of GPU memory raises `OutOfGpuMemory` (an `EngineDeadError`).
* With `structured_outputs`, vLLM loads the model's tokenizer and a `generate` may carry
  a grammar (vLLM's `StructuredOutputsParams`): the sample's tokens are drawn from the
  constrained distribution, and their logprobs are that distribution's (vLLM applies the
  grammar's mask before it takes logprobs; a token the grammar forces has logprob 0).
* Bad requests (prompt too long, bad sampling values, a grammar vLLM cannot build) come
  back as samples with `finish_reason=ERROR`, a one-line `error` and `refused` (nothing
  was sampled); they never disturb other requests.
  A dead engine raises `EngineDeadError` from every call.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roles.generation.errors import EngineDeadError, OutOfGpuMemory
from roles.generation.inproc import Finished, InprocEngine
from roles.weights.errors import StaleUpdate
from roles.weights.worker_calls import BUCKET_LOADS, PEER_WAITING_CALLS, WorkerCall
from runtime.config import EngineConfig
from runtime.errors import one_line
from runtime.logs import get_logger
from runtime.memory.gpu import is_out_of_memory
from transport.wire import FinishReason, SamplingSpec

log = get_logger("rollout")
WORKER_EXTENSION = "roles.weights.worker_ext.TandemWorkerExtension"
SLEEP_TAGS = ("weights", "kv_cache")  # vLLM's memory tags, woken in this order
_FINISH = {"length": FinishReason.LENGTH, "stop": FinishReason.STOP, "abort": FinishReason.ABORT}


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    prompt_len: int
    gen_s: float
    error: str = ""
    refused: bool = False  # vLLM raised for the request (it refused it): nothing was sampled
    routed_experts: Any = None  # numpy [N, layers, top_k]: the experts each of the first N tokens went to


@dataclass
class LoraServing:
    """vLLM's LoRA settings and where the rollout keeps its adapters (runtime/config/lora_settings.py)."""

    max_rank: int
    max_loras: int
    config: dict[str, Any]  # adapter_config.json fields
    adapters_dir: Path  # one PEFT directory per version held, v<version>/
    initial: Path | None = None  # the adapter of the starting version (a resumed run)


@dataclass
class _Active:
    """A sample in flight: from which token count on each version sampled it."""

    marks: list[tuple[int, int]] = field(default_factory=list)


class RolloutEngine:
    """One in-process vLLM engine plus version bookkeeping; create, then `await start()`."""

    def __init__(
        self,
        cfg: EngineConfig,
        model_path: str,
        *,
        version: int = 0,
        prefix_salt: bool = True,
        sleep_mode: bool = False,
        lora: LoraServing | None = None,
        reload_wait_s: float = 600.0,
        structured_outputs: bool = False,
        seeded: bool = False,
        routed_experts: bool = False,
    ) -> None:
        """`sleep_mode`: start vLLM with sleep mode, so `sleep` can free its GPU memory;
        `lora`: serve LoRA adapters (updates are adapters); `reload_wait_s`: how long a
        request waits for an update to reload weights that a level-2 sleep discarded;
        `structured_outputs`: requests may carry grammars (vLLM then loads the tokenizer);
        `seeded`: requests may carry seeds (`engine_kwargs`); `routed_experts`: every sample
        carries the experts an MoE model routed its tokens to (`Sample.routed_experts`)."""
        self.cfg = cfg
        self.seeded = seeded
        self.routed_experts = routed_experts
        self.sleep_mode = sleep_mode
        self.structured_outputs = structured_outputs
        self.lora = lora
        self.adapter: tuple[int, str] | None = None  # (version, directory) new requests run on
        self._lora_fallback_logged = False  # vLLM refused an adapter from tensors (said once)
        self.model_path = model_path
        self.version = version
        self.prefix_salt = prefix_salt and cfg.enable_prefix_caching
        self.engine: Any = None  # an InprocEngine once started
        self._active: dict[str, _Active] = {}
        self._updating: int | None = None  # the version of the open update
        self._sleep_lock = asyncio.Lock()
        self._asleep: set[str] = set()  # vLLM's sleeping memory tags: "weights", "kv_cache"
        self.reload_wait_s = reload_wait_s
        self._weights_valid = asyncio.Event()  # cleared while a level-2 sleep has discarded them
        self._weights_valid.set()
        self.tokens_generated = 0
        self._quiet_from = time.monotonic()  # the stall watchdog's idle mark (see last_step_at)
        self._calls: dict[object, tuple[str, float]] = {}  # engine calls in progress: (what, since)

    async def start(self) -> None:
        if not os.path.isdir(self.model_path):
            raise FileNotFoundError(f"model.path '{self.model_path}' is not a directory")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.cfg.cpu_kvcache_gb))
        kwargs = engine_kwargs(
            self.cfg,
            self.model_path,
            sleep_mode=self.sleep_mode,
            lora=self.lora,
            structured_outputs=self.structured_outputs,
            seeded=self.seeded,
            routed_experts=self.routed_experts,
        )
        log.info("engine_args", args=kwargs)  # benchmarks/rollout.py compares these with its bare engine's
        engine = InprocEngine(kwargs)
        await engine.start()
        self.engine = engine
        if self.lora is not None and self.lora.initial is not None:
            self.adapter = (self.version, str(self.lora.initial))  # vLLM reads it at the first request

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def steps_seen(self) -> int:
        """Engine steps taken since the start."""
        return int(self.engine.steps) if self.engine is not None else 0

    @property
    def last_step_at(self) -> float:
        """When the engine last ended a step (monotonic), or the idle mark the stall
        watchdog set since, whichever is later."""
        stepped = self.engine.last_step_at if self.engine is not None else 0.0
        return max(stepped, self._quiet_from)

    @last_step_at.setter
    def last_step_at(self, when: float) -> None:
        self._quiet_from = when

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        spec: SamplingSpec,
        index: int = 0,
        *,
        timeout_s: float = 0.0,
        structured: Any = None,
    ) -> Sample:
        """One completion of `prompt_ids` (sample `index` of request `request_id`). With
        `timeout_s`, a sample not finished by then is aborted and comes back as an error;
        `structured` (vLLM's `StructuredOutputsParams`, an engine started with
        `structured_outputs`) constrains it to a grammar."""
        self._check_alive()
        if self.sleep_mode:
            await self._await_weights()
            await self.wake(self.cfg.call_timeout_s)  # waits for a sleep in progress, too
        started = time.perf_counter()
        vid = f"{request_id}#{index}"
        state = _Active(marks=[(0, self.version)])
        try:
            params = _sampling_params(spec, index, structured)
            prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_ids)}
            if self.prefix_salt:
                prompt["cache_salt"] = f"v{self.version}"
            result, timed_out = await self._run(vid, prompt, params, state, self._lora_request(), timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # vLLM raises several types for bad requests
            self._check_alive(exc)
            prefix = "bad sampling params: " if isinstance(exc, _BadParams) else ""
            error = prefix + one_line(exc.__cause__ or exc)
            return _error_sample(prompt_ids, started, error, state, refused=True)
        finally:
            self._active.pop(vid, None)
        if timed_out:
            return _error_sample(prompt_ids, started, f"request timed out after {timeout_s:g}s", state, result)
        return self._finish(state, result, len(prompt_ids), started)

    def _lora_request(self) -> Any:
        """The current version's adapter for a new request (None: the base model)."""
        if self.adapter is None:
            return None
        from vllm.lora.request import LoRARequest

        version, path = self.adapter
        return LoRARequest(lora_name=f"v{version}", lora_int_id=version + 1, lora_path=path)

    async def _run(
        self, vid: str, prompt: dict[str, Any], params: Any, state: _Active, lora: Any, timeout_s: float
    ) -> tuple[Finished, bool]:
        """Add the request and wait for its end; past `timeout_s` (0: none) abort it and
        return what it sampled so far, marked as timed out. The sample counts as active
        (and `abort_all` reaches it) from here on."""
        done = self.engine.add_request(vid, prompt, params, lora_request=lora)
        self._active[vid] = state
        try:
            return await asyncio.wait_for(asyncio.shield(done), timeout_s or None), False
        except TimeoutError:
            await self._bounded(self.engine.abort(vid), self.cfg.call_timeout_s, "abort")
            return await asyncio.wait_for(done, self.cfg.call_timeout_s), True
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):  # a wedged engine must not hold the cancellation
                await asyncio.wait_for(self.engine.abort(vid), self.cfg.call_timeout_s)
            raise

    def _finish(self, state: _Active, result: Finished, prompt_len: int, started: float) -> Sample:
        reason = _FINISH.get(result.finish_reason or "abort", FinishReason.STOP)
        self.tokens_generated += len(result.token_ids)
        versions = _versions(len(result.token_ids), state.marks)
        elapsed = time.perf_counter() - started
        logprobs = result.logprobs[: len(result.token_ids)]
        sample = Sample(result.token_ids, logprobs, versions, reason, prompt_len, elapsed)
        sample.routed_experts = result.routed_experts
        return sample

    async def abort_all(self) -> int:
        """Abort every active sample; each returns with its tokens so far. Returns how many."""
        vids = list(self._active)
        if vids:
            await self._bounded(self.engine.abort(vids), self.cfg.call_timeout_s, "abort")
        return len(vids)

    # --- weight updates: begin (pause), load buckets, finish (switch version, resume) -----
    async def begin_update(self, version: int, timeout_s: float) -> float:
        """Pause scheduling (requests kept) and open an update to `version` in the workers.
        Raises StaleUpdate for a version older than the engine's. Returns the pause time."""
        if version < self.version:
            raise StaleUpdate(f"update to version {version} refused: rollout is at version {self.version}")
        self._check_alive()
        t0 = time.perf_counter()
        self._updating = version  # from here on, abandon_update resumes the engine
        if self.lora is not None:  # an adapter: requests go on, nothing they use changes
            try:
                if self.sleep_mode:  # vLLM's LoRA slots sleep with its weights: the adapter goes into them awake
                    await self._wake(["weights"], timeout_s)
                await self._rpc(WorkerCall.BEGIN_UPDATE, {"lora": True}, timeout_s)
            except BaseException:
                await self.abandon_update(timeout_s)
                raise
            return time.perf_counter() - t0
        try:
            if self.sleep_mode:  # the KV cache stays asleep until a request needs it
                await self._wake(["weights"], timeout_s)
            t1 = time.perf_counter()
            await self._bounded(self.engine.pause_generation(), timeout_s, "pause")
            t2 = time.perf_counter()
            await self._rpc(WorkerCall.BEGIN_UPDATE, None, timeout_s)
        except BaseException:
            await self.abandon_update(timeout_s)
            raise
        t3 = time.perf_counter()
        log.info(
            "update_paused",
            update=version,
            wake_s=round(t1 - t0, 4),
            pause_s=round(t2 - t1, 4),
            begin_s=round(t3 - t2, 4),
            active=len(self._active),
        )
        return t3 - t0

    async def apply_weights(self, version: int, manifest: dict[str, Any], timeout_s: float) -> dict[str, float]:
        """A whole update from a version staged in shared memory (the zmq backend):
        begin, load, finish. Returns the phase times (pause_s, load_s, total_s)."""
        t0 = time.perf_counter()
        pause_s = await self.begin_update(version, timeout_s)
        try:
            times = await self.load_bucket(WorkerCall.LOAD_STAGED, manifest, timeout_s)
        except BaseException:
            await self.abandon_update(timeout_s)
            raise
        await self.finish_update(timeout_s)
        return {"pause_s": pause_s, "load_s": times["load_s"], "total_s": time.perf_counter() - t0}

    async def load_bucket(self, method: WorkerCall, spec: Any, timeout_s: float) -> dict[str, float]:
        """Run worker load `method` (one of BUCKET_LOADS) on `spec` inside the open update;
        its slowest worker's times."""
        if method not in BUCKET_LOADS:
            raise ValueError(f"{method} does not load a bucket")
        if self._updating is None:
            raise RuntimeError(f"{method}: no update is open")
        results = await self._rpc(method, spec, timeout_s)
        return {k: max(float(r.get(k, 0.0)) for r in results) for k in ("receive_s", "load_s")}

    async def finish_update(self, timeout_s: float) -> None:
        """Close the open update, switch to its version and resume."""
        version = self._updating
        if version is None:
            raise RuntimeError("finish_update: no update is open")
        if self.lora is not None:
            await self._finish_adapter(version, self.lora, timeout_s)
            return
        try:
            await self._rpc(WorkerCall.FINISH_UPDATE, None, timeout_s)
            self._weights_valid.set()  # every weight was sent: whatever a level-2 sleep discarded is back
            # Paused with no step in flight: the counts are exactly what the old weights sampled.
            counts = await self._bounded(self.engine.output_counts(list(self._active)), timeout_s, "output_counts")
            self._switch_version(version, counts)
        finally:
            await self._end_update(timeout_s)
        if not self._active:
            await self._bounded(self.engine.reset_prefix_cache(), timeout_s, "reset_prefix_cache")

    async def _finish_adapter(self, version: int, lora: LoraServing, timeout_s: float) -> None:
        """Register the update as adapter `version + 1`, keep the adapters that requests in
        flight run on, drop the others (and their directories)."""
        path = lora.adapters_dir / f"v{version}"
        in_flight = {s.marks[0][1] for s in self._active.values()}
        keep = {v + 1 for v in in_flight} | {version + 1}
        spec = {"lora": {"id": version + 1, "path": str(path), "config": lora.config, "keep": sorted(keep)}}
        try:
            results = await self._rpc(WorkerCall.FINISH_UPDATE, spec, timeout_s)
        finally:
            await self._end_update(timeout_s)
        first = results[0] if results else {}
        if first.get("error") and not self._lora_fallback_logged:
            self._lora_fallback_logged = True
            log.warning("lora_from_tensors_unavailable", error=first["error"], fallback="adapter directory")
        self.version = version
        self.adapter = (version, str(path))
        for old in lora.adapters_dir.glob("v*"):
            if old.name[1:].isdigit() and int(old.name[1:]) + 1 not in keep:
                shutil.rmtree(old, ignore_errors=True)

    async def abandon_update(self, timeout_s: float) -> None:
        """Close the open update without switching versions (a failure mid-way: layers
        loaded before it keep the new weights) and resume."""
        if self._updating is None:
            return
        try:
            await self._rpc(WorkerCall.FINISH_UPDATE, None, timeout_s)
        except Exception as exc:  # the engine stalled or died; resuming still matters
            log.warning("update_close_failed", error=one_line(exc))
        finally:
            await self._end_update(timeout_s)

    async def _end_update(self, timeout_s: float) -> None:
        self._updating = None
        if self.lora is not None:
            return  # an adapter update never paused generation
        await self._bounded(self.engine.resume_generation(), timeout_s, "resume")

    @property
    def updating(self) -> int | None:
        """The version of the update that is open, if one is."""
        return self._updating

    async def init_weight_group(self, spec: dict[str, Any], timeout_s: float) -> list[Any]:
        """Every worker joins the trainer's weight group (generation goes on meanwhile)."""
        self._check_alive()
        return await self._rpc(WorkerCall.INIT_WEIGHT_GROUP, spec, timeout_s)

    async def close_weight_group(self, timeout_s: float) -> None:
        """Every worker leaves its weight group, so a trainer still sending fails at once."""
        await self._rpc(WorkerCall.CLOSE_WEIGHT_GROUP, None, timeout_s)

    async def _rpc(self, method: WorkerCall, arg: Any, timeout_s: float) -> list[Any]:
        args = () if arg is None else (arg,)
        waits_on_peer = method in PEER_WAITING_CALLS
        call = self.engine.collective_rpc(method, args=args)
        return await self._bounded(call, timeout_s, method, watched=not waits_on_peer)  # type: ignore[no-any-return]

    async def _bounded(self, call: Any, timeout_s: float, what: str, *, watched: bool = True) -> Any:
        """`call` within `timeout_s`; while it runs, a `watched` call counts in
        `oldest_call` (the stall watchdog's view: the engine alone must answer it)."""
        key = object()
        if watched:
            self._calls[key] = (what, time.monotonic())
        try:
            return await asyncio.wait_for(call, timeout_s)
        except TimeoutError:
            raise TimeoutError(f"vLLM engine call {what} did not return in {timeout_s:g}s") from None
        except Exception as exc:
            if is_out_of_memory(exc):
                raise OutOfGpuMemory(what, exc) from exc
            raise
        finally:
            self._calls.pop(key, None)

    def oldest_call(self) -> tuple[str, float] | None:
        """The engine call (pause, update phases, resume, sleep, ...) waiting longest for the
        engine, and for how many seconds; None when none is waiting."""
        if not self._calls:
            return None
        what, since = min(self._calls.values(), key=lambda c: c[1])
        return what, time.monotonic() - since

    # --- sleep mode (colocated synchronous runs) -----------------------------------------
    @property
    def sleeping(self) -> bool:
        """Whether any of vLLM's memory (weights, KV cache) is asleep."""
        return bool(self._asleep)

    @property
    def weights_discarded(self) -> bool:
        """Whether a level-2 sleep discarded the weights and no update has reloaded them yet."""
        return not self._weights_valid.is_set()

    async def sleep(self, timeout_s: float, level: int = 1) -> bool:
        """Free the KV cache and move the weights to host memory (vLLM sleep level 1), or
        discard them (level 2: only when the next update replaces every weight; never with
        adapters, whose updates keep the base weights). Whether it slept (not when already
        asleep or while an update is open)."""
        if level not in (1, 2) or (level == 2 and self.lora is not None):
            raise ValueError(f"sleep level {level} is not available here (1, or 2 without LoRA adapters)")
        async with self._sleep_lock:
            if self._asleep or self._updating is not None:
                return False
            await self._bounded(self.engine.sleep(level=level), timeout_s, f"sleep (level {level})")
            self._asleep = set(SLEEP_TAGS)
            if level == 2:
                self._weights_valid.clear()
            return True

    async def _await_weights(self) -> None:
        """Wait (at most `reload_wait_s`) for an update to reload discarded weights."""
        if self._weights_valid.is_set():
            return
        try:
            await asyncio.wait_for(self._weights_valid.wait(), self.reload_wait_s)
        except TimeoutError:
            raise EngineDeadError(
                f"vLLM's weights were discarded by a level-2 sleep and no update reloaded them in "
                f"{self.reload_wait_s:g}s; a request cannot be served (rollout.engine.sleep_level=1 keeps a host copy)"
            ) from None

    async def wake(self, timeout_s: float) -> None:
        """Undo `sleep` for whatever still sleeps (no-op when awake)."""
        await self._wake(None, timeout_s)

    async def _wake(self, tags: list[str] | None, timeout_s: float) -> bool:
        """Wake `tags` (None: all) where asleep, after any sleep in progress; whether it did.
        An update wakes the weights only: the KV cache wakes for the first request after it,
        once the trainer has given its memory back (roles/trainer/role.py)."""
        async with self._sleep_lock:
            waking = [t for t in (tags or SLEEP_TAGS) if t in self._asleep]
            if not waking:
                return False
            what = f"wake_up ({', '.join(waking)})"
            try:
                await self._bounded(self.engine.wake_up(tags=waking), timeout_s, what)
            except (EngineDeadError, TimeoutError):
                raise
            except Exception as exc:  # memory half mapped back: nothing more can run on this engine
                raise EngineDeadError(f"vLLM {what} failed: {one_line(exc)}") from exc
            self._asleep -= set(waking)
            return True

    async def device(self) -> dict[str, str]:
        """Where the workers run: {"type": "cuda" | "cpu", "gpu_uuid": "GPU-..." or ""}."""
        results = await self._rpc(WorkerCall.DEVICE, None, self.cfg.call_timeout_s)
        return results[0]  # type: ignore[no-any-return]

    async def memory(self) -> dict[str, float]:
        """The first worker's GPU memory in GB: free on the device, reserved and allocated by
        its torch allocator (counters that include vLLM's pools even while sleep has unmapped
        them: `free_gb` says what a sleeping engine holds)."""
        results = await self._rpc(WorkerCall.MEMORY, None, self.cfg.call_timeout_s)
        return results[0]  # type: ignore[no-any-return]

    def _switch_version(self, version: int, counts: dict[str, int]) -> None:
        self.version = version
        for vid, state in self._active.items():
            state.marks.append((counts.get(vid, 0), version))

    async def checksums(self) -> dict[str, float]:
        """Sum (float64) of every vLLM parameter, by name, in the first worker (refused
        while the weights sleep: their memory is not mapped then)."""
        self._check_weights_awake()
        results = await self._rpc(WorkerCall.CHECKSUMS, None, self.cfg.call_timeout_s)
        return results[0]  # type: ignore[no-any-return]

    async def checksum(self) -> float:
        self._check_weights_awake()
        results = await self._rpc(WorkerCall.CHECKSUM, None, self.cfg.call_timeout_s)
        return float(results[0])

    def _check_weights_awake(self) -> None:
        if "weights" in self._asleep:
            raise RuntimeError("vLLM's weights are asleep (the trainer is stepping); ask after the next update")

    def _check_alive(self, cause: BaseException | None = None) -> None:
        if self.engine is not None and self.engine.errored:
            raise EngineDeadError(f"vLLM engine died: {one_line(cause or self.engine.dead_error)}")
        if isinstance(cause, EngineDeadError):
            raise cause

    def stats(self) -> dict[str, Any]:
        """The scheduler's running and waiting requests and KV-cache use (about a second old)."""
        stats = dict(getattr(self.engine, "stats", None) or {})
        return {
            "running": stats.get("running", len(self._active)),
            "waiting": stats.get("waiting", 0),
            "kv_cache_usage": stats.get("kv_cache_usage", 0.0),
        }

    async def shutdown(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            await asyncio.to_thread(engine.shutdown)


class _BadParams(ValueError):
    pass


def engine_kwargs(
    cfg: EngineConfig,
    model_path: str,
    *,
    sleep_mode: bool = False,
    lora: LoraServing | None = None,
    structured_outputs: bool = False,
    seeded: bool = False,
    routed_experts: bool = False,
) -> dict[str, Any]:
    """The keyword arguments of vLLM's `AsyncEngineArgs` a rollout engine starts with (plain
    values: a bare engine built from them is configured as the role's). vLLM's grammars need
    its tokenizer; without `structured_outputs` it is not loaded. With `seeded` (requests
    may carry seeds) a CPU engine does not chunk prefills: vLLM rewinds a seeded request's
    generator after a partial prefill, which only a CUDA generator allows (vLLM-CPU's engine
    dies with 'CPU Generator does not use offset'). With `routed_experts` (MoE routing replay)
    vLLM reports the experts it routed every token to, in the model runner that can."""
    kwargs: dict[str, Any] = dict(
        model=model_path,
        skip_tokenizer_init=not structured_outputs,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        tensor_parallel_size=cfg.tensor_parallel_size,
        enforce_eager=cfg.enforce_eager,
        seed=cfg.seed,
        max_num_seqs=cfg.max_num_seqs,
        enable_prefix_caching=cfg.enable_prefix_caching,
        worker_extension_cls=WORKER_EXTENSION,
        enable_sleep_mode=sleep_mode,
        disable_log_stats=True,
    )
    if lora is not None:
        n = lora.max_loras
        kwargs.update(enable_lora=True, max_lora_rank=lora.max_rank, max_loras=n, max_cpu_loras=n)
    if routed_experts:
        kwargs["enable_return_routed_experts"] = True
        if importlib.util.find_spec("vllm.config.aux_output") is not None:
            # vLLM 0.32 reports routing through its aux-output connector, which only its V2 model
            # runner has; vLLM 0.26's V1 runner reports it itself (and its V2 cannot).
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    if seeded and _cpu_platform():
        kwargs["enable_chunked_prefill"] = False  # vLLM then batches at least max_model_len tokens
    return kwargs


def _cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _sampling_params(spec: SamplingSpec, index: int, structured: Any = None) -> Any:
    """vLLM params for one sample: its final output only (versions are marked by token
    count at each update, not read off per-token outputs), under grammar `structured`."""
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
            output_kind=RequestOutputKind.FINAL_ONLY,
            structured_outputs=structured,
        )
    except Exception as exc:  # vLLM validates with several exception types
        raise _BadParams(str(exc)) from exc


def _versions(n: int, marks: list[tuple[int, int]]) -> list[int]:
    out = [0] * n
    for start, version in marks:
        for i in range(start, n):
            out[i] = version
    return out


def _error_sample(
    prompt_ids: list[int],
    started: float,
    error: str,
    state: _Active,
    so_far: Finished | None = None,
    refused: bool = False,
) -> Sample:
    """A failed sample, with the tokens it had sampled (a timed-out request's) if any."""
    tokens = so_far.token_ids if so_far is not None else []
    logprobs = so_far.logprobs[: len(tokens)] if so_far is not None else []
    versions = _versions(len(tokens), state.marks)
    elapsed = time.perf_counter() - started
    return Sample(tokens, logprobs, versions, FinishReason.ERROR, len(prompt_ids), elapsed, error, refused)
