"""The controller: one per run, on CPU. Owns the dataset cursor, the staleness gate, the
groups in flight, batch assembly and metrics; every other role only serves its requests.

Accounting invariant: every admitted group is, at any time, in exactly one of
`self.groups` (dispatched, waiting for samples or scores) or `self.ready` (queued for
training), or has left through training or `drop`, each of which counts it once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque

from roles.controller import state as cstate
from roles.controller.dataset import PromptDataset
from roles.controller.gate import StalenessGate
from roles.controller.groups import Group, SampleRec
from roles.controller.metrics import MetricsSink
from roles.controller.peers import Peer, Registry
from roles.controller.scoring import Scoring
from roles.controller.training import StepRunner
from runtime import addresses, checkpoint
from runtime.logs import get_logger, set_policy_version
from runtime.paths import metrics_path, model_dir
from runtime.placement import role_counts
from runtime.role import FatalError, Role
from transport import wire
from transport.endpoint import Envelope
from transport.rpc import PeerUnreachable
from transport.sockets import bind_router

log = get_logger("controller")


class Controller(Role):
    kind = "controller"
    registers = False

    async def setup(self) -> None:
        from transformers import AutoTokenizer

        cfg = self.cfg
        self.run_id = uuid.uuid4().hex[:12]
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir(cfg)))
        self.dataset = PromptDataset(cfg.data, self.tokenizer, cfg.seed)
        self.n = cfg.rollout.n
        self.batch_size = cfg.trainer.prompts_per_step * self.n
        self.gate = StalenessGate(self.batch_size, cfg.rollout.max_staleness)
        self.registry = Registry()
        self.expected = role_counts(cfg)
        self.groups: dict[int, Group] = {}
        self.ready: deque[Group] = deque()
        self.redo: deque[Group] = deque()  # in flight at the checkpoint we resumed from
        self.next_gid = 0
        self.step = 0
        self.wall_offset = 0.0
        self.trained_uids: list[int] = []
        self.totals = {"dropped_stale": 0, "dropped_error": 0, "trained_groups": 0, "admitted_groups": 0}
        self.step_drops: dict[str, int] = {}
        self.wake = asyncio.Event()
        self.ready_changed = asyncio.Event()
        self.registered_event = asyncio.Event()
        self.started = False
        self.trainer_lock = asyncio.Lock()  # one collective at a time, in the same order on every rank
        self.critic_lock = asyncio.Lock()
        self.sampling = self._sampling_spec()
        self.scoring = Scoring(self)
        self.steps = StepRunner(self)
        resume = checkpoint.resume_dir()
        if resume is not None:
            self._restore(cstate.decode((resume / "controller.json").read_bytes()), resume)
        opts = addresses.channel_options(cfg, self.ctx.run_dir)
        bind = addresses.controller_bind_address(cfg, self.ctx.run_dir)
        self.server = bind_router(self.zmq, bind, name="controller", options=opts)
        self.server.start(self._on_message, on_peer_lost=self._peer_lost)
        self.metrics = MetricsSink(metrics_path(cfg), cfg.metrics, self.ctx.run_dir, cfg.name)
        log.info("controller_listening", address=self.server.address, batch_size=self.batch_size)

    def _sampling_spec(self) -> wire.SamplingSpec:
        r = self.cfg.rollout
        stops = list(r.stop_token_ids)
        eos = self.tokenizer.eos_token_id
        if eos is not None and not r.ignore_eos and eos not in stops:
            stops.append(eos)
        return wire.SamplingSpec(
            n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens,
            stop_token_ids=stops, ignore_eos=r.ignore_eos, seed=None,
        )  # fmt: skip

    # --- main loop -------------------------------------------------------------------
    async def run(self) -> None:
        await self._wait_registered()
        self.steps.start_clock()
        self.started = True
        self.spawn("dispatcher", self._dispatch_loop())
        if self.cfg.rollout.elastic:
            self.spawn("rollout-watch", self._watch_rollouts())
        if self.scoring.gae:
            self.spawn("values", self.scoring.value_loop())
        self.wake.set()
        while self.step < self.cfg.trainer.total_steps:
            await self.steps.step()
        self._log_accounting()
        await self._shutdown_peers("training finished")
        self.metrics.close()

    async def _wait_registered(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while not self._all_registered():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                have = {k: self.registry.count(k) for k in self.expected}
                raise FatalError(
                    f"roles did not register in {self.cfg.startup_timeout_s:g}s: have {have}, need {self.expected}"
                )
            self.registered_event.clear()
            try:
                await asyncio.wait_for(self.registered_event.wait(), remaining)
            except TimeoutError:
                continue
        await self._send_rollout_peers()
        await self.sync_lagging_rollouts()
        log.info("all_registered", peers=[p.name for p in self.registry.peers.values()])

    def _all_registered(self) -> bool:
        return all(self.registry.count(k) >= n for k, n in self.expected.items() if k != "controller")

    async def _send_rollout_peers(self) -> None:
        msg = wire.Peers(role="rollout", peers=[p.info for p in self.registry.of("rollout")])
        for t in self.registry.of("trainer"):
            await self.server.send(msg, peer=t.identity)

    async def sync_lagging_rollouts(self) -> None:
        """Rollouts behind the trainer (resumed without weights, or new) get the current ones."""
        lagging = [p.info for p in self.registry.of("rollout") if p.version < self.gate.version]
        if not lagging:
            return
        log.info("syncing_rollouts", rollouts=[f"{i.role}-{i.rank}" for i in lagging], version=self.gate.version)
        msg = wire.SyncWeights(rollouts=lagging)
        timeout = self.cfg.weight_sync.timeout_s * 3
        await asyncio.gather(
            *[self.server.request(msg, peer=t.identity, timeout=timeout) for t in self.registry.of("trainer")]
        )

    # --- dispatch --------------------------------------------------------------------
    async def _dispatch_loop(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            while self.redo and (rollout := self._pick_rollout()) is not None:
                group = self.redo.popleft()
                await self._dispatch(rollout, group)
                log.info("redispatched", group=group.gid, uid=group.prompt.uid, to=rollout.name, attempt=group.attempts)
            while self._want_more() and self.gate.can_admit(self.n):
                rollout = self._pick_rollout()
                if rollout is None:
                    break
                await self._dispatch(rollout)

    def _want_more(self) -> bool:
        buffered = self.gate.in_flight() // self.batch_size
        return self.step + buffered < self.cfg.trainer.total_steps

    def _pick_rollout(self) -> Peer | None:
        floor = self.gate.version - self.gate.max_staleness
        cap = self.cfg.rollout.engine.max_num_seqs
        ok = [p for p in self.registry.of("rollout") if p.version >= floor and p.in_flight + self.n <= cap]
        return min(ok, key=lambda p: p.in_flight) if ok else None

    async def _dispatch(self, rollout: Peer, group: Group | None = None) -> None:
        if group is None:
            prompt = self.dataset.next()
            gid = self.next_gid
            group = Group(gid=gid, prompt=prompt, n=self.n, request_id=f"g{gid}", admitted_version=self.gate.version)
            self.next_gid += 1
            self.gate.admit(self.n)
            self.totals["admitted_groups"] += 1
        group.rollout = rollout.identity
        group.dispatched_at = time.monotonic()
        self.groups[group.gid] = group
        rollout.in_flight += self.n
        rollout.clock.add(self.n)
        msg = wire.Generate(
            request_id=group.request_id, group_id=group.gid, prompt_ids=group.prompt.prompt_ids, sampling=self.sampling
        )
        try:
            await self.server.send(msg, peer=rollout.identity)
        except PeerUnreachable:
            # Gone before its heartbeat ran out; elastic runs hand this group (and the rest
            # of the worker's) to the survivors.
            self.rollout_failed(rollout.name, "not connected")

    def make_ready(self, group: Group) -> None:
        if self.groups.pop(group.gid, None) is not None:
            self.ready.append(group)
            self.ready_changed.set()

    def drop(self, group: Group, counter: str, why: str) -> None:
        self.groups.pop(group.gid, None)
        self.gate.drop(group.n)
        self.totals[counter] += 1
        self.step_drops[counter] = self.step_drops.get(counter, 0) + group.n
        log.info("group_dropped", group=group.gid, reason=counter, why=why)
        self.wake.set()

    def gen_busy_s(self) -> float:
        rollouts = self.registry.of("rollout")
        return sum(p.clock.busy_s() for p in rollouts) / max(1, len(rollouts))

    # --- messages --------------------------------------------------------------------
    async def _on_message(self, env: Envelope) -> wire.Message | None:
        msg = env.msg
        if isinstance(msg, wire.Register):
            return self._register(env.peer, msg)
        if isinstance(msg, wire.Completion):
            self._completion(env.peer, msg)
        elif isinstance(msg, wire.WeightsApplied):
            peer = self.registry.get(env.peer)
            if peer is not None:
                peer.version = max(peer.version, msg.version)
                self.wake.set()
        elif isinstance(msg, wire.Dead):
            peer = self.registry.get(env.peer)
            if msg.role == "rollout" and self.cfg.rollout.elastic and peer is not None:
                self.lose_rollout(peer, f"died: {msg.cause}")
            else:
                self.fail(f"role {msg.role}-{msg.rank} died: {msg.cause}")
        else:
            log.warning("unexpected_message", type=type(msg).__name__, peer=_name(env.peer))
        return None

    def _register(self, identity: bytes | None, msg: wire.Register) -> wire.Message:
        assert identity is not None
        peer = self.registry.add(identity, msg.peer)
        log.info("registered", peer=peer.name, address=msg.peer.address, version=msg.peer.version, pid=msg.pid)
        self.registered_event.set()
        if self.started and peer.info.role == "rollout":
            log.info("worker_joined", peer=peer.name, version=peer.version, trainer_version=self.gate.version)
            self.spawn(f"join-{peer.name}", self._welcome(peer))
        self.wake.set()
        peers = [p.info for p in self.registry.peers.values()]
        return wire.Registered(run_id=self.run_id, peers=peers, policy_version=self.gate.version)

    def _completion(self, identity: bytes | None, msg: wire.Completion) -> None:
        group = self.groups.get(msg.group_id)
        rollout = self.registry.get(identity)
        if group is None or group.rollout != identity or msg.sample_index in group.samples:
            log.warning("completion_ignored", group=msg.group_id, sample=msg.sample_index, peer=_name(identity))
            return
        if rollout is not None:
            rollout.in_flight -= 1
            rollout.served += 1
            rollout.clock.done()
        group.samples[msg.sample_index] = SampleRec(
            index=msg.sample_index, token_ids=msg.token_ids.clone(), logprobs=msg.logprobs.clone(),
            versions=msg.versions.clone(), finish_reason=msg.finish_reason, error=msg.error,
        )  # fmt: skip
        self.wake.set()
        if group.complete:
            if group.error:
                self.drop(group, "dropped_error", group.error)
            else:
                self.spawn(f"score-{group.gid}", self.scoring.score(group))

    def _peer_lost(self, identity: bytes | None) -> None:
        peer = self.registry.get(identity)
        if peer is None or self.stopping or not peer.alive:
            return
        why = f"silent for {self.cfg.transport.peer_timeout_s:g}s"
        if peer.info.role == "rollout" and self.cfg.rollout.elastic:
            self.lose_rollout(peer, why)
        else:
            self.fail(f"role {peer.name} went {why}")

    # --- elastic rollouts ------------------------------------------------------------
    async def _welcome(self, peer: Peer) -> None:
        """A rollout that joined mid-run: tell the trainers, then give it the current weights."""
        await self._send_rollout_peers()
        await self.sync_lagging_rollouts()

    def rollout_failed(self, name: str, why: str) -> None:
        peer = next((p for p in self.registry.of("rollout") if p.name == name), None)
        if peer is None:
            return
        if self.cfg.rollout.elastic:
            self.lose_rollout(peer, why)
        else:
            self.fail(f"rollout {name}: {why}")

    def lose_rollout(self, peer: Peer, why: str) -> None:
        """Forget a rollout worker and hand its unfinished groups to the survivors."""
        peer.alive = False
        moved = [g for g in self.groups.values() if g.rollout == peer.identity and not g.complete]
        for g in moved:
            self.groups.pop(g.gid)
            g.samples.clear()
            g.rollout = b""
            g.attempts += 1
        self.redo.extendleft(reversed(moved))
        peer.clock.done(peer.in_flight)
        peer.in_flight = 0
        self.server.forget(peer.identity)
        log.warning(
            "worker_lost", peer=peer.name, reason=why, redispatch=len(moved), uids=[g.prompt.uid for g in moved]
        )
        self.spawn(f"lost-{peer.name}-{time.monotonic():.3f}", self._send_rollout_peers())
        self.wake.set()

    async def _watch_rollouts(self) -> None:
        """Elastic runs fail when no rollout worker is left for `elastic_grace_s`."""
        empty_since: float | None = None
        while True:
            await asyncio.sleep(1.0)
            if self.registry.of("rollout"):
                empty_since = None
                continue
            empty_since = empty_since or time.monotonic()
            if time.monotonic() - empty_since > self.cfg.rollout.elastic_grace_s:
                raise FatalError(f"no rollout worker for {self.cfg.rollout.elastic_grace_s:g}s")

    def _log_accounting(self) -> None:
        """Every admitted group: trained, dropped, or still pending when training ended."""
        pending = len(self.groups) + len(self.ready) + len(self.redo)
        t = self.totals
        left = t["admitted_groups"] - t["trained_groups"] - t["dropped_stale"] - t["dropped_error"] - pending
        served = {p.name: p.served for p in self.registry.peers.values() if p.info.role == "rollout"}
        log.info("training_done", steps=self.step, pending_groups=pending, unaccounted=left, served=served, **t)

    # --- checkpoints -----------------------------------------------------------------
    def snapshot(self) -> cstate.ControllerState:
        """The state a resumed run continues from (taken between steps)."""
        in_flight = [cstate.group_state(g, with_samples=False) for g in self.groups.values()]
        in_flight += [cstate.group_state(g, with_samples=False) for g in self.redo]
        return cstate.ControllerState(
            step=self.step, version=self.gate.version, next_gid=self.next_gid, dataset=self.dataset.state(),
            gate=self.gate.state(), totals=dict(self.totals), ready=[cstate.group_state(g) for g in self.ready],
            in_flight=in_flight, trained_uids=list(self.trained_uids), kl_coef=self.scoring.kl_ctl.value,
        )  # fmt: skip

    def _restore(self, st: cstate.ControllerState, path: object) -> None:
        self.step, self.next_gid = st.step, st.next_gid
        self.dataset.restore(st.dataset)
        self.totals.update(st.totals)
        self.trained_uids = list(st.trained_uids)
        self.ready.extend(cstate.restore_group(g) for g in st.ready)
        self.redo.extend(cstate.restore_group(g) for g in st.in_flight)
        g = st.gate
        pending = sum(grp.n for grp in [*self.ready, *self.redo])
        self.gate.version, self.gate.trained, self.gate.dropped = st.version, g["trained"], g["dropped"]
        self.gate.admitted = g["trained"] + g["dropped"] + pending
        self.scoring.kl_ctl.value = st.kl_coef or self.scoring.kl_ctl.value
        set_policy_version(st.version)
        self.wall_offset = self._truncate_metrics(st.step)
        log.info(
            "resumed",
            checkpoint=str(path),
            step=st.step,
            version=st.version,
            ready=len(self.ready),
            redo=len(self.redo),
        )

    def _truncate_metrics(self, step: int) -> float:
        """Keep metrics.jsonl up to the checkpoint's step (later lines are redone); last wall_s."""
        import json

        path = metrics_path(self.cfg)
        if not path.exists():
            return 0.0
        kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))
        return float(json.loads(kept[-1])["wall_s"]) if kept else 0.0

    async def _shutdown_peers(self, reason: str) -> None:
        for p in list(self.registry.peers.values()):
            try:
                await self.server.send(wire.Shutdown(reason=reason), peer=p.identity)
            except Exception:  # a peer that is gone needs no shutdown
                pass
        await asyncio.sleep(0.1)

    async def close(self) -> None:
        if hasattr(self, "server"):
            await self.server.aclose()


def _name(identity: bytes | None) -> str:
    return identity.decode(errors="replace") if identity else "?"
