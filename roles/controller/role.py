"""The controller: one per run, on CPU. It wires the pipeline and answers the roles'
messages; every other role only serves its requests.

    Dispatcher ──Generate──▶ rollouts ──Completion──▶ Dispatcher.on_completion
        ──▶ Scorer (reward, reward_model, teacher) ──▶ ValueStage (GAE, with a critic) ──▶ Ledger.complete
        ──▶ StepRunner (Ledger.wait_batch → trainer ranks → Ledger.trained) ──▶ Checkpointer

The ledger (ledger.py) is the one owner of the accounting invariant: every admitted group
is trained or dropped exactly once. The stages get only what they use and hand groups on
through the ledger and their queues. Who is in the run (registration, rollouts that join
or are lost in an elastic run, the shutdown at the end) is membership.py's.

Checkpoints: every `checkpoint.every` steps, at the end of the first step
`checkpoint.every_minutes` after the last one (or the start), and after the last step
(`checkpoint.final`). A preemption (SIGUSR1, which the launcher sends on SIGTERM or SIGINT:
`preempt`) lets the step whose batch is with the trainer finish (one still waiting for its
batch is abandoned, the batch given back), saves a checkpoint of that step within
`checkpoint.preempt_grace_s`, logs `preempted` and stops every role; the run then ends
with exit 0 and the launcher names the checkpoint and the resume command.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec

from roles.algo.shaping import overlong_penalty
from roles.controller import state as cstate
from roles.controller.budgets import response_budget
from roles.controller.checkpointing import Checkpointer, truncate_metrics
from roles.controller.dataset import Prompt, PromptDataset
from roles.controller.dispatch import Dispatcher
from roles.controller.error_rate import ErrorRate
from roles.controller.groups import Group
from roles.controller.ledger import Ledger
from roles.controller.membership import Membership, MembershipRules
from roles.controller.metrics import MetricsSink
from roles.controller.peers import Peer, Registry
from roles.controller.ppo import RewardKL
from roles.controller.ranks import RankGroup
from roles.controller.schedule import NoSchedule, ScheduleLog
from roles.controller.scoring import Scorer, Weights
from roles.controller.sleep_before_step import SleepBeforeStep
from roles.controller.step_metrics import StepRecorder
from roles.controller.step_runner import StepRunner
from roles.controller.teaching import TeacherMeter, Teaching
from roles.controller.validation import Validator
from roles.controller.values import ValueStage
from runtime.checkpoints import base_model, checkpoint, resume_settings
from runtime.config.placement import role_counts
from runtime.data.prompts import limit_text, prompt_limit
from runtime.identity import addresses
from runtime.identity.paths import SCHEDULE, metrics_path, model_dir
from runtime.identity.run_token import read_token
from runtime.launch.rendezvous import CONTROLLER_FD_ENV, handed_fd
from runtime.logs import get_logger, set_policy_version
from runtime.role import FatalError, Role
from transport import wire
from transport.endpoint import Envelope
from transport.sockets import bind_router
from transport.throttle import Throttled

log = get_logger("controller")


class Controller(Role):
    kind = "controller"
    registers = False

    async def setup(self) -> None:
        from transformers import AutoTokenizer

        cfg = self.cfg
        self.run_id = uuid.uuid4().hex[:12]
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir(cfg)))
        self.dataset = PromptDataset(cfg.data, self.tokenizer, cfg.seed, limit=prompt_limit(cfg))
        kl = cfg.algorithm.kl
        gae = cfg.algorithm.advantage == "gae"
        self.reward_kl = RewardKL(kl) if gae and kl.enabled and kl.use == "reward" else None
        m = cfg.metrics
        path, cap = self.ctx.run_dir / SCHEDULE, m.schedule_max_mb << 20
        self.schedule = ScheduleLog(path, max_bytes=cap) if m.schedule else NoSchedule()
        self.ledger, wall_offset = self._ledger()
        self.registry = Registry()
        self.noisy = Throttled(log)
        opts = addresses.channel_options(cfg, self.ctx.run_dir)  # a tighter cap: no role sends it much
        opts = dataclasses.replace(opts, max_message_bytes=cfg.transport.max_control_message_mb << 20)
        bind = addresses.controller_bind_address(cfg, self.ctx.run_dir)
        listen_fd = handed_fd(CONTROLLER_FD_ENV) if bind.startswith("tcp://") else None  # the launcher's socket
        self.server = bind_router(self.zmq, bind, name="controller", options=opts, listen_fd=listen_fd)
        self._build_stages(gae, wall_offset)
        self.server.start(self._on_message, on_peer_lost=self.membership.peer_lost)
        log.info("controller_listening", address=self.server.address, batch_size=self.ledger.gate.batch_size)

    def _ledger(self) -> tuple[Ledger, float]:
        """A new ledger, or the one of the checkpoint this run resumes from (with the
        wall time the run had reached then)."""
        cfg = self.cfg
        a = cfg.algorithm
        shape: dict[str, Any] = dict(
            group_size=cfg.rollout.n,
            prompts_per_step=cfg.trainer.prompts_per_step,
            max_staleness=cfg.rollout.max_staleness,
            total_steps=cfg.trainer.total_steps,
            filter_groups=a.filter_groups,
            max_filtered_per_step=a.max_filter_rounds * cfg.trainer.prompts_per_step,
        )
        shape["schedule"] = self.schedule
        resume = checkpoint.resume_dir()
        if resume is None:
            return Ledger(**shape), 0.0
        st = cstate.decode((resume / "controller.json").read_bytes())
        ledger = Ledger.restore(st.ledger, **shape)
        self.dataset.restore(st.dataset)
        if self.reward_kl is not None and st.kl_coef:
            self.reward_kl.ctl.value = st.kl_coef
        set_policy_version(ledger.version)
        log.info(
            "resumed",
            checkpoint=str(resume),
            step=ledger.step,
            version=ledger.version,
            ready=len(ledger.ready),
            redo=len(ledger.redo),
        )
        return ledger, truncate_metrics(metrics_path(cfg), ledger.step)

    def _build_stages(self, gae: bool, wall_offset: float) -> None:
        cfg = self.cfg
        self.trainers = RankGroup("trainer", self.server, self.registry)
        self.critics = RankGroup("critic", self.server, self.registry) if gae else None
        self.dispatcher = Dispatcher(
            self.ledger,
            self.dataset,
            self.registry,
            self.server,
            self._sampling_spec(),
            max_num_seqs=cfg.rollout.engine.max_num_seqs,
            on_unreachable=self._unreachable,
            schedule=self.schedule,
            budget=response_budget(cfg.rollout, cfg.seed),
            sample_seed=cfg.seed if cfg.rollout.seeded_sampling else None,
        )
        self.membership = Membership(
            self.registry,
            self.server,
            self.trainers,
            self.dispatcher,
            self._membership_rules(),
            run_id=self.run_id,
            version=lambda: self.ledger.version,
            host=self,
        )
        self.values: ValueStage | None = None
        if self.critics is not None:
            a = cfg.algorithm
            self.values = ValueStage(
                self.critics,
                gamma=a.gamma,
                lam=a.lam,
                kl=self.reward_kl,
                timeout_s=max(600.0, cfg.weight_sync.timeout_s),
                done=self.ledger.complete,
            )
        d = cfg.algorithm.distill
        self.teaching = (
            Teaching(self.server, self.registry, timeout_s=d.timeout_s, schedule=self.schedule) if d.enabled else None
        )
        r = cfg.reward
        self.scorer = Scorer(
            self.server,
            self.registry,
            self.tokenizer,
            timeout_s=r.timeout_s,
            done=self.values.submit if self.values is not None else self.ledger.complete,
            shaping=self._shaping(),
            functions=len(r.functions),
            concurrency=r.concurrency,
            max_magnitude=r.max_magnitude,
            model_timeout_s=r.judge.timeout_s if r.judge.model else r.model.timeout_s,
            weights=Weights(functions=r.function_weight, model=r.model_weight),
            function_names=tuple(r.functions),
            teacher=self.teaching.score if self.teaching is not None else None,
        )
        self.errors = ErrorRate(cfg.rollout.max_error_fraction, 2 * cfg.trainer.prompts_per_step)
        self.metrics = MetricsSink(metrics_path(cfg), cfg.metrics, self.ctx.run_dir, cfg.name)
        self.recorder = StepRecorder(self.metrics, self.dispatcher.gen_busy_s, wall_offset=wall_offset)
        self.steps = StepRunner(
            self.ledger,
            self.trainers,
            self.critics,
            cfg.algorithm,
            self.recorder,
            timeout_s=max(600.0, cfg.weight_sync.timeout_s * 3),
            reward_kl=self.reward_kl,
            on_rollout_failed=self.membership.rollout_failed,
            max_reward_failures=cfg.reward.max_failure_fraction,
            schedule=self.schedule,
            before_train=self._sleep_before_steps(),
            max_nonfinite_steps=cfg.trainer.max_nonfinite_steps,
            last_checkpoint=self._last_checkpoint,
            more_metrics=self._prompt_metrics,
            agent=bool(cfg.rollout.agent) or cfg.data.source == "verifiers",
            batch_metrics=TeacherMeter(self.teaching).metrics if self.teaching is not None else None,
        )
        self.validator: Validator | None = None
        if cfg.validation.every:
            self.validator = Validator(
                cfg.validation,
                self._validation_prompts(),
                self._validation_sampling(),
                self.dispatcher,
                self.scorer.submit,
                self.metrics.write_validation,
                self.schedule,
            )
        ranks = [self.trainers] + ([self.critics] if self.critics is not None else [])
        self.checkpointer = Checkpointer(
            self.ctx.run_dir,
            ranks,
            self.snapshot,
            keep=cfg.checkpoint.keep,
            timeout_s=cfg.checkpoint.timeout_s,
            base_model=base_model.identity(model_dir(cfg)) if model_dir(cfg).is_dir() else None,
            settings=resume_settings.settings(cfg),
        )
        if checkpoint.resume_dir() is not None:
            self.checkpointer.last_step = self.ledger.step  # the checkpoint resumed from is this step's

    def _membership_rules(self) -> MembershipRules:
        cfg = self.cfg
        return MembershipRules(
            expected=role_counts(cfg),
            token=read_token(self.ctx.run_dir),
            elastic=cfg.rollout.elastic,
            elastic_grace_s=cfg.rollout.elastic_grace_s,
            peer_timeout_s=cfg.transport.peer_timeout_s,
            sync_timeout_s=cfg.weight_sync.timeout_s * 3,
        )

    def _shaping(self) -> Callable[[int], float] | None:
        o = self.cfg.reward.overlong
        if not o.enabled:
            return None
        return partial(overlong_penalty, max_tokens=self.cfg.rollout.max_tokens, buffer=o.buffer, penalty=o.penalty)

    def _validation_prompts(self) -> list[Prompt]:
        """The validation file's prompts in file order (the first `max_prompts`), or
        `max_prompts` (64 when 0) synthetic ones of another seed; over-long ones are left out."""
        v, d = self.cfg.validation, self.cfg.data
        synthetic = v.data == "synthetic"
        data = msgspec.structs.replace(
            d,
            source="synthetic" if synthetic else "file",
            path="" if synthetic else v.data,
            shuffle=False,
            synthetic_num_prompts=v.max_prompts or 64,
        )
        ds = PromptDataset(data, self.tokenizer, self.cfg.seed + 1)
        rows = range(min(len(ds), v.max_prompts or len(ds)))
        limit = prompt_limit(self.cfg)
        prompts = [p for p in (ds.encode(r) for r in rows) if len(p.prompt_ids) <= limit]
        if not prompts:  # the launcher checked a validation file; synthetic prompts are the training task's
            raise FatalError(f"validation.data: every prompt is longer than {limit_text(self.cfg)}")
        return prompts

    def _validation_sampling(self) -> wire.SamplingSpec:
        v, train = self.cfg.validation, self._sampling_spec()
        return msgspec.structs.replace(
            train,
            n=v.n,
            temperature=v.temperature,
            top_p=v.top_p,
            top_k=0 if v.temperature == 0 else train.top_k,
            max_tokens=v.max_tokens or train.max_tokens,
        )

    def _sampling_spec(self) -> wire.SamplingSpec:
        r = self.cfg.rollout
        stops = list(r.stop_token_ids)
        eos = self.tokenizer.eos_token_id
        if eos is not None and not r.ignore_eos and eos not in stops:
            stops.append(eos)
        return wire.SamplingSpec(
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=r.max_tokens,
            stop_token_ids=stops,
            ignore_eos=r.ignore_eos,
            seed=None,
        )

    # --- main loop -------------------------------------------------------------------
    async def run(self) -> None:
        await self.membership.wait_all(self.cfg.startup_timeout_s)
        self.recorder.start_clock()
        self.schedule.run(self.ledger.step, self.ledger.version, self.ledger.next_gid)
        self.membership.open()
        self.spawn("dispatcher", self.dispatcher.run())
        self.spawn("scorer", self.scorer.run())
        if self.values is not None:
            self.spawn("values", self.values.run())
        if self.cfg.rollout.elastic:
            self.spawn("rollout-watch", self.membership.watch_rollouts())
        self.dispatcher.wake()
        if self.ledger.step == 0:
            self._validate()
        self.last_save_at = time.monotonic()
        while self.ledger.step < self.cfg.trainer.total_steps and not self.preempting:
            self.step_task = asyncio.ensure_future(self.steps.step())
            try:
                await self.step_task
            except asyncio.CancelledError:
                if not self.preempting or _cancelling():
                    raise
                break  # abandoned before its batch went to the trainer: nothing of it was trained
            self._validate()
            if self._checkpoint_due() and not self.preempting:
                await self._save()
        if self.preempting:
            await self._preempted()
            return
        if self.cfg.checkpoint.final and self.ledger.step and self.checkpointer.last_step != self.ledger.step:
            await self._save()  # the model at the end: what `tandem export` writes
        if self.validator is not None:
            await self.validator.drain()
        served = {p.name: p.served for p in self.registry.peers.values() if p.info.role == "rollout"}
        log.info("training_done", steps=self.ledger.step, served=served, **self.ledger.accounting())
        await self.membership.shutdown_all("training finished")
        self.metrics.close()
        self.schedule.close()

    preempting = False
    step_task: asyncio.Future[None] | None = None
    last_save_at = 0.0

    def _checkpoint_due(self) -> bool:
        """A checkpoint is due after this step: `every` steps, or `every_minutes` since the last."""
        c, step = self.cfg.checkpoint, self.ledger.step
        if c.every and step % c.every == 0:
            return True
        return bool(c.every_minutes) and time.monotonic() - self.last_save_at >= 60.0 * c.every_minutes

    async def _save(self, timeout_s: float | None = None) -> None:
        await self.checkpointer.save(timeout_s)
        self.last_save_at = time.monotonic()

    def _prompt_metrics(self) -> dict[str, float]:
        """Prompts skipped as too long: this step, and since the run began."""
        ds = self.dataset
        return {
            "prompts_skipped_too_long": float(ds.take_skipped()),
            "prompts_skipped_too_long_total": float(ds.skipped_too_long),
        }

    def _last_checkpoint(self) -> str:
        """The newest intact checkpoint of the run ("" when none)."""
        found = checkpoint.find_latest(self.ctx.run_dir, quiet=True)
        return str(found[0]) if found else ""

    def preempt(self) -> None:
        """SIGUSR1 (the launcher's SIGTERM or SIGINT): checkpoint and stop (module docstring)."""
        if self.preempting:
            return
        self.preempting = True
        self.preempt_deadline = time.monotonic() + self.cfg.checkpoint.preempt_grace_s
        in_training = self.steps.in_training if hasattr(self, "steps") else False
        log.info(
            "preempting",
            step=self.ledger.step if hasattr(self, "ledger") else 0,
            step_in_training=in_training,
            grace_s=self.cfg.checkpoint.preempt_grace_s,
        )
        if not hasattr(self, "membership"):  # still setting up
            self.request_stop("interrupted while setting up")
        elif self.step_task is None:  # not stepping yet: nothing to save
            self.spawn("interrupted", self._stop_all("interrupted before the first step"))
        elif not self.step_task.done() and not in_training:
            self.step_task.cancel()

    async def _preempted(self) -> None:
        """After the step in flight: a checkpoint of it (unless one is there or nothing was
        trained), then every role stops."""
        started = time.monotonic()
        step = self.ledger.step
        if step and self.checkpointer.last_step != step:
            await self._save(timeout_s=max(1.0, self.preempt_deadline - time.monotonic() - 1.0))
        path = self._last_checkpoint()
        log.info("preempted", step=step, checkpoint=path, seconds=round(time.monotonic() - started, 3))
        await self._stop_all(f"interrupted at step {step}")

    async def _stop_all(self, reason: str) -> None:
        await self.membership.shutdown_all(reason)
        self.metrics.close()
        self.schedule.close()
        self.request_stop(reason)

    def _validate(self) -> None:
        """Start a validation round when one is due (training goes on meanwhile)."""
        if self.validator is not None and self.validator.due(self.ledger.step):
            round_ = self.validator.start(self.ledger.step, self.ledger.version)
            if round_ is not None:
                self.spawn(f"validation-{self.ledger.step}", round_)

    def snapshot(self) -> cstate.ControllerState:
        """The state a resumed run continues from (taken between steps)."""
        kl_coef = self.reward_kl.coef if self.reward_kl is not None else 0.0
        return cstate.ControllerState(ledger=self.ledger.state(), dataset=self.dataset.state(), kl_coef=kl_coef)

    # --- messages --------------------------------------------------------------------
    async def _on_message(self, env: Envelope) -> wire.Message | None:
        msg = env.msg
        if isinstance(msg, wire.Register):
            return self.membership.register(env.peer, msg)
        if isinstance(msg, wire.Completion):
            group = self.dispatcher.on_completion(env.peer, msg)
            if group is not None:
                self._sampled(group)
        elif isinstance(msg, wire.WeightsApplied):
            peer = self.registry.get(env.peer)
            if peer is not None:
                peer.version = max(peer.version, msg.version)
                self.schedule.sync(peer.name, msg.version, msg.total_s, msg.receive_s, msg.load_s)
                self.dispatcher.wake()
        elif isinstance(msg, wire.Dead):
            self.membership.dead(env.peer, msg)
        else:
            self.noisy.warning("unexpected_message", type=type(msg).__name__, peer=_name(env.peer))
        return None

    def _sampled(self, group: Group) -> None:
        """Every sample of `group` is in: score it, or drop it when a request failed (and
        end the run when too many do: `ErrorRate`)."""
        if group.error:
            self.ledger.drop(group, "error", group.error)
        else:
            self.scorer.submit(group)
        cause = self.errors.record(group.error)
        if cause:
            self.fail(cause)

    def _sleep_before_steps(self) -> SleepBeforeStep | None:
        """A synchronous run puts rollouts that share a trainer's GPU to sleep before each step."""
        if self.cfg.rollout.max_staleness != 0:
            return None
        return SleepBeforeStep(self.server, self.registry, timeout_s=self.cfg.rollout.engine.call_timeout_s + 5.0)

    def _unreachable(self, peer: Peer, why: str) -> None:
        """The dispatcher's report (it is built before the membership it reports to)."""
        self.membership.unreachable(peer, why)

    async def close(self) -> None:
        if hasattr(self, "schedule"):
            self.schedule.close()  # a failed run keeps its schedule up to the failure
        if hasattr(self, "server"):
            await self.server.aclose()


def _cancelling() -> bool:
    """Whether the running task itself is being cancelled (not only a task it awaits)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _name(identity: bytes | None) -> str:
    return identity.decode(errors="replace") if identity else "?"
