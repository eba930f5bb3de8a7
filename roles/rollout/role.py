"""The rollout role: serves generate requests from the controller on one vLLM engine and
applies weight updates from the trainer in place.

Channels:
* controller (DEALER): `Generate` in; one `Completion` out per sample, as soon as that
  sample finishes (with `rollout.env`, once its last turn is done: roles/rollout/multiturn.py);
  `Shutdown`.
* weights (ROUTER, address advertised at registration): every weight-sync backend's
  requests (roles/weights/receiver.py); after each applied update a `WeightsApplied`
  goes to the controller too, so it always knows this rollout's version.

With `rollout.engine.sleep_when_idle`, a synchronous run (`max_staleness: 0`) whose
rollout shares a GPU with a trainer rank puts vLLM to sleep when the controller says the
step's samples are all in (`SleepBeforeStep`, before it hands the trainer the batch), and answers
once asleep, so the trainer steps with that memory: at `rollout.engine.sleep_level` 2 the
weights are discarded (the next update replaces every one), at 1 (and with adapters) they
are kept in host memory. The next update wakes the weights, the next request the KV cache.
A dead engine, or one that ran out of GPU memory (waking, loading weights), ends the role
with that cause (for memory: what it asked for, what the GPU holds and who holds it).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from roles.generation.engine import LoraServing, RolloutEngine, Sample
from roles.generation.errors import EngineDeadError, OutOfGpuMemory
from roles.rollout.completion import completion_message
from roles.weights.receiver import WeightReceiver
from runtime.checkpoints.checkpoint import read_manifest, resume_dir
from runtime.config.lora_settings import adapter_config, engine_lora_rank, engine_max_loras
from runtime.config.placement import rollout_sleeps
from runtime.errors import one_line
from runtime.identity import addresses
from runtime.identity.paths import model_dir
from runtime.identity.run_token import read_token
from runtime.launch.start_order import mark_started
from runtime.logs import get_logger, set_policy_version
from runtime.memory.estimate import sleep_level
from runtime.memory.gpu import gpu_memory, gpu_processes, out_of_memory_cause
from runtime.role import Role
from transport import wire
from transport.endpoint import Envelope
from transport.rpc import RpcEndpoint
from transport.sockets import bind_router

from .agents import AgentRunner, serves_agents, setup_agents
from .multiturn import EpisodeRunner

log = get_logger("rollout")


class RolloutRole(Role):
    kind = "rollout"

    async def setup(self) -> None:
        cfg = self.cfg
        path, version = model_dir(cfg), 0
        resume = resume_dir()
        lora = self._lora_serving()
        if resume is not None and (resume / "hf").is_dir():
            path, version = resume / "hf", int(read_manifest(resume)["version"])
        if resume is not None and lora is not None and (resume / "adapter").is_dir():
            version, lora.initial = int(read_manifest(resume)["version"]), resume / "adapter"
        self.sleeps = rollout_sleeps(self.cfg, self.ctx.rank)
        self.episodes: EpisodeRunner | None = None
        if cfg.rollout.env:  # multi-turn: the environment speaks text, so the rollout needs the tokenizer
            from transformers import AutoTokenizer

            self.episodes = EpisodeRunner(cfg.rollout, AutoTokenizer.from_pretrained(str(path)))
        self.sleep_level = sleep_level(cfg)
        self.engine = RolloutEngine(
            cfg.rollout.engine,
            str(path),
            version=version,
            sleep_mode=self.sleeps,
            lora=lora,
            reload_wait_s=max(600.0, cfg.weight_sync.timeout_s * 3),  # the controller's bound on a step
            structured_outputs=serves_agents(cfg),  # the endpoint's tool_choice / response_format grammars
            seeded=cfg.rollout.seeded_sampling,
            routed_experts=cfg.algorithm.routing_replay != "disabled",
        )
        log.info("engine_starting", model=str(path))  # the console's progress note: a start takes minutes
        started = time.perf_counter()
        await self.engine.start()
        self.device = await self.engine.device()
        mark_started(self.ctx.run_dir, self.ctx.name)  # a torch role on this GPU may build now
        log.info(
            "engine_started",
            seconds=round(time.perf_counter() - started, 2),
            engine_core="in-process",
            device=self.device,
            sleep_when_idle=self.sleeps,
            sleep_level=self.sleep_level if self.sleeps else None,
        )
        set_policy_version(self.engine.version)
        self.agents: AgentRunner | None = None
        if serves_agents(cfg):
            self.agents = await setup_agents(cfg, self.ctx.run_dir, self.ctx.rank, self.engine, str(path))
            log.info("endpoint_started", url=self.agents.server.base_url)
        opts = addresses.channel_options(cfg, self.ctx.run_dir)
        bind = addresses.server_bind_address(cfg, self.ctx.run_dir, f"{self.ctx.name}-weights", self.ctx.rank)
        self.weights: RpcEndpoint = bind_router(self.zmq, bind, name="weights", options=opts)
        self.receiver = WeightReceiver(
            self.engine,
            self.ctx.name,
            local_host=_host(addresses.advertised(self.weights.address)),
            timeout_s=cfg.weight_sync.timeout_s,
            token=read_token(self.ctx.run_dir),
            on_applied=self._applied,
            on_failure=self._update_failed,
            max_version=cfg.trainer.total_steps,
        )
        self.weights.start(self._on_weights)
        self.samples: set[asyncio.Task[Any]] = set()
        self.spawn("engine-watch", self._watch_engine())
        self.spawn("engine-stats", self._log_stats())

    def _lora_serving(self) -> LoraServing | None:
        """vLLM's LoRA settings when the trainer trains adapters (runtime/config/lora_settings.py)."""
        cfg = self.cfg
        if not cfg.trainer.lora.rank:
            return None
        return LoraServing(
            max_rank=engine_lora_rank(cfg),
            max_loras=engine_max_loras(cfg),
            config=adapter_config(cfg.trainer.lora),
            adapters_dir=Path(cfg.run_dir) / "adapters" / self.ctx.name,
        )

    def on_registered(self, reply: wire.Registered) -> None:
        self.receiver.expect_sync(reply.policy_version)  # a rollout behind the trainer is synced to it next

    def peer_info(self) -> wire.PeerInfo:
        info = super().peer_info()
        info.address = addresses.advertised(self.weights.address)
        info.version = self.engine.version
        info.capabilities["max_num_seqs"] = self.cfg.rollout.engine.max_num_seqs
        info.capabilities["gpu_uuid"] = self.device.get("gpu_uuid", "")
        info.capabilities["sleeps"] = int(self.sleeps)  # the controller sends `SleepBeforeStep` before each step
        return info

    async def handle(self, env: Envelope) -> wire.Message | None:
        msg = env.msg
        if isinstance(msg, wire.Generate):
            for i in range(max(1, msg.sampling.n)):
                task = asyncio.create_task(self._sample(msg, i), name=f"sample-{msg.request_id}-{i}")
                self.samples.add(task)
                task.add_done_callback(self.samples.discard)
            return None
        if isinstance(msg, wire.SleepBeforeStep):
            return await self._rest(msg.version)
        return self.unserved(msg)

    async def _rest(self, version: int) -> wire.Ack:
        """Sleep while the trainer steps (see module docs); the reply says how. Samples in
        flight (a validation round) keep vLLM awake; weights of another version than the
        step's (the next update then might not replace them all) are kept, at level 1."""
        if not self.sleeps:
            return wire.Ack(info="awake: this rollout does not sleep")
        if self.samples:
            log.info("engine_stays_awake", samples=len(self.samples))
            return wire.Ack(info=f"awake: {len(self.samples)} samples in flight")
        level = self.sleep_level if self.engine.version == version else 1
        started = time.perf_counter()
        try:
            slept = await self.engine.sleep(self.cfg.rollout.engine.call_timeout_s, level)
        except EngineDeadError as exc:
            await self._engine_failed(exc)
            return wire.Ack(info=f"failed: {exc}")
        if not slept:
            return wire.Ack(info="unchanged: " + ("already asleep" if self.engine.sleeping else "an update is open"))
        seconds = round(time.perf_counter() - started, 3)
        log.info("engine_sleeping", seconds=seconds, level=level, **await self._worker_memory())
        return wire.Ack(info=f"asleep: level {level}")

    async def _worker_memory(self) -> dict[str, float]:
        """The vLLM worker's GPU memory for the log (nothing when the query fails: it is a fact, not a step)."""
        try:
            return await self.engine.memory()
        except Exception:
            return {}

    async def _sample(self, req: wire.Generate, index: int) -> None:
        try:
            if self.agents is not None:
                done = await self.agents.complete(self.engine, req, index)
            elif self.episodes is not None:
                done = await self.episodes.complete(self.engine, req, index)
            else:
                timeout_s = self.cfg.rollout.request_timeout_s
                sample = await self.engine.generate(
                    req.request_id, req.prompt_ids, req.sampling, index, timeout_s=timeout_s
                )
                done = _completion(req, index, sample)
        except EngineDeadError as exc:
            await self._engine_failed(exc)
            return
        except Exception as exc:  # a sample lost here would leave its step waiting forever
            self.fail(f"sample {index} of request {req.request_id} failed: {one_line(exc)}")
            return
        if done.error:
            log.warning("request_failed", request_id=req.request_id, sample=index, error=done.error)
        assert self.controller is not None
        await self.controller.send(done)

    async def _engine_failed(self, exc: EngineDeadError) -> None:
        """End the role with the engine's cause; out of GPU memory, with what the GPU holds."""
        cause = str(exc)
        if isinstance(exc, OutOfGpuMemory):
            uuid = self.device.get("gpu_uuid", "")
            cause = await asyncio.to_thread(
                lambda: out_of_memory_cause(
                    self.ctx.name,
                    f"vLLM {exc.what}",
                    exc.__cause__ or exc,
                    gpu=gpu_memory(uuid) if uuid else None,
                    processes=gpu_processes(uuid),
                    config_path=str(self.ctx.run_dir / "config.yaml"),
                )
            )
        self.fail(cause)

    async def _update_failed(self, exc: BaseException) -> str | None:
        """A weight update failed: a dead engine ends the role (its cause, returned, goes to
        the trainer too); any other failure leaves the rollout on its old version."""
        if not isinstance(exc, EngineDeadError):
            return None
        await self._engine_failed(exc)
        return self._fatal

    async def _on_weights(self, env: Envelope) -> wire.Message | None:
        return await self.receiver.handle(env.msg)

    async def _applied(self, applied: wire.WeightsApplied, pause_s: float) -> None:
        """A version is loaded: log it and tell the controller (both backends)."""
        set_policy_version(applied.version)
        log.info(
            "weights_applied",
            receive_s=round(applied.receive_s, 4),
            load_s=round(applied.load_s, 4),
            pause_s=round(pause_s, 4),
            total_s=round(applied.total_s, 4),
            mb=round(applied.num_bytes / 2**20, 2),
        )
        if self.controller is not None:
            await self.controller.send(applied)

    async def _watch_engine(self) -> None:
        """The role dies with the engine: when vLLM reports it dead, when samples are in
        flight and no engine step came for `rollout.stall_timeout_s`, or when an engine call
        that only the engine must answer (pause, a weight load, resume, ...) has waited that
        long (a wedged engine)."""
        while True:
            await asyncio.sleep(1.0)
            if self.engine.engine is not None and self.engine.engine.errored:
                raise EngineDeadError(f"vLLM engine died: {self.engine.engine.dead_error}")
            # The first steps compile and warm kernels: they get the start-up bound.
            stall_s = self.cfg.rollout.stall_timeout_s
            if self.engine.steps_seen < 2:
                stall_s = max(stall_s, self.cfg.startup_timeout_s)
            quiet = time.monotonic() - self.engine.last_step_at
            waiting = self.engine.num_active and self.engine.updating is None and not self.engine.sleeping
            if waiting and quiet > stall_s:
                raise EngineDeadError(
                    f"vLLM engine made no progress for {quiet:.0f}s with {self.engine.num_active} samples in flight "
                    f"(rollout.stall_timeout_s={stall_s:g})"
                )
            if not waiting:
                self.engine.last_step_at = max(self.engine.last_step_at, time.monotonic() - 1.0)
            call = self.engine.oldest_call()
            if call is not None and call[1] > self.cfg.rollout.stall_timeout_s:
                raise EngineDeadError(
                    f"vLLM engine made no progress: its call {call[0]} waited {call[1]:.0f}s "
                    f"(rollout.stall_timeout_s={self.cfg.rollout.stall_timeout_s:g})"
                )

    async def _log_stats(self) -> None:
        interval = self.cfg.rollout.stats_interval_s
        last_tokens, last_t = self.engine.tokens_generated, time.perf_counter()
        while True:
            await asyncio.sleep(interval)
            now, tokens = time.perf_counter(), self.engine.tokens_generated
            tps = (tokens - last_tokens) / (now - last_t)
            last_tokens, last_t = tokens, now
            log.info("engine_stats", tokens_per_s=round(tps, 1), **self.engine.stats())

    async def drain(self) -> None:
        """Let in-flight samples finish for `drain_timeout_s`, then abort the rest."""
        if self.samples:
            _, pending = await asyncio.wait(set(self.samples), timeout=self.cfg.rollout.drain_timeout_s)
            if pending:
                n = await self.engine.abort_all()
                log.info("drain_aborted", requests=n)
                await asyncio.wait(pending, timeout=2.0)

    async def close(self) -> None:
        if getattr(self, "agents", None) is not None:
            await self.agents.close()  # type: ignore[union-attr]
        if hasattr(self, "weights"):
            await self.weights.aclose()
        if hasattr(self, "receiver"):
            self.receiver.close()
        if hasattr(self, "engine"):
            await self.engine.shutdown()


def _host(address: str) -> str:
    """The host of a tcp:// address; loopback for ipc:// (one node)."""
    if address.startswith("tcp://"):
        return address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return "127.0.0.1"


def _completion(req: wire.Generate, index: int, s: Sample) -> wire.Completion:
    return completion_message(
        req,
        index,
        token_ids=s.token_ids,
        logprobs=s.logprobs,
        versions=s.versions,
        finish_reason=s.finish_reason,
        prompt_len=s.prompt_len,
        gen_s=s.gen_s,
        error=s.error,
        routed_experts=s.routed_experts,
    )
