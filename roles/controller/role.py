"""The controller: one per run, on CPU. Owns the dataset cursor, the staleness gate, the
groups in flight, advantages, batch assembly and metrics; every other role only serves
its requests.

Accounting invariant: every admitted group is, at any time, in exactly one of
`self.groups` (dispatched, waiting for samples or rewards) or `self.ready` (queued for
training), or has left through `_trained` or `_dropped`, each of which counts it once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from typing import Any

from roles.controller.batching import build_train_batches
from roles.controller.dataset import PromptDataset
from roles.controller.gate import StalenessGate
from roles.controller.groups import Group, SampleRec
from roles.controller.metrics import MetricsSink
from roles.controller.peers import Peer, Registry
from runtime import addresses
from runtime.logs import get_logger, set_policy_version
from runtime.paths import metrics_path, model_dir
from runtime.placement import role_counts
from runtime.role import FatalError, Role
from transport import wire
from transport.channels import Envelope, RemoteError, RequestTimeout, bind_router

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
        self.next_gid = 0
        self.step = 0
        self.totals = {"dropped_stale": 0, "dropped_error": 0, "trained_groups": 0, "admitted_groups": 0}
        self.step_drops: dict[str, int] = {}
        self.wake = asyncio.Event()
        self.ready_changed = asyncio.Event()
        self.registered = asyncio.Event()
        self.reward_rr = 0
        self.sampling = self._sampling_spec()
        opts = addresses.channel_options(cfg, self.ctx.run_dir)
        self.server = bind_router(self.zmq, self.ctx.controller_address, name="controller", options=opts)
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
        self.run_started = time.monotonic()
        self.last_step_at = self.run_started
        self.last_busy = self._busy_snapshot()
        self.spawn("dispatcher", self._dispatch_loop())
        self.wake.set()
        while self.step < self.cfg.trainer.total_steps:
            await self._train_step()
        log.info("training_done", steps=self.step, **self.totals)
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
            self.registered.clear()
            try:
                await asyncio.wait_for(self.registered.wait(), remaining)
            except TimeoutError:
                continue
        await self._send_rollout_peers()
        log.info("all_registered", peers=[p.name for p in self.registry.peers.values()])

    def _all_registered(self) -> bool:
        return all(self.registry.count(k) >= n for k, n in self.expected.items() if k != "controller")

    async def _send_rollout_peers(self) -> None:
        msg = wire.Peers(role="rollout", peers=[p.info for p in self.registry.of("rollout")])
        for t in self.registry.of("trainer"):
            await self.server.send(msg, peer=t.identity)

    # --- dispatch --------------------------------------------------------------------
    async def _dispatch_loop(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            while self.step + self._steps_buffered() < self.cfg.trainer.total_steps and self.gate.can_admit(self.n):
                rollout = self._pick_rollout()
                if rollout is None:
                    break
                await self._dispatch(rollout)

    def _steps_buffered(self) -> int:
        return self.gate.in_flight() // self.batch_size

    def _pick_rollout(self) -> Peer | None:
        floor = self.gate.version - self.gate.max_staleness
        cap = self.cfg.rollout.engine.max_num_seqs
        ok = [p for p in self.registry.of("rollout") if p.version >= floor and p.in_flight + self.n <= cap]
        return min(ok, key=lambda p: p.in_flight) if ok else None

    async def _dispatch(self, rollout: Peer, group: Group | None = None) -> None:
        if group is None:
            prompt = self.dataset.next()
            group = Group(
                gid=self.next_gid,
                prompt=prompt,
                n=self.n,
                request_id=f"g{self.next_gid}",
                admitted_version=self.gate.version,
            )
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
        await self.server.send(msg, peer=rollout.identity)

    # --- messages --------------------------------------------------------------------
    async def _on_message(self, env: Envelope) -> wire.Message | None:
        msg = env.msg
        if isinstance(msg, wire.Register):
            return self._register(env.peer, msg)
        if isinstance(msg, wire.Completion):
            self._completion(env.peer, msg)
        elif isinstance(msg, wire.WeightsApplied):
            self._weights_applied(env.peer, msg)
        elif isinstance(msg, wire.Dead):
            self._dead(msg)
        else:
            log.warning("unexpected_message", type=type(msg).__name__, peer=_name(env.peer))
        return None

    def _register(self, identity: bytes | None, msg: wire.Register) -> wire.Message:
        assert identity is not None
        peer = self.registry.add(identity, msg.peer)
        log.info("registered", peer=peer.name, address=msg.peer.address, version=msg.peer.version, pid=msg.pid)
        self.registered.set()
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
            rollout.clock.done()
        group.samples[msg.sample_index] = SampleRec(
            index=msg.sample_index, token_ids=msg.token_ids.clone(), logprobs=msg.logprobs.clone(),
            versions=msg.versions.clone(), finish_reason=msg.finish_reason, error=msg.error,
        )  # fmt: skip
        self.wake.set()
        if group.complete:
            if group.error:
                self._dropped(group, "dropped_error", group.error)
            else:
                self.spawn(f"reward-{group.gid}", self._score(group))

    def _weights_applied(self, identity: bytes | None, msg: wire.WeightsApplied) -> None:
        peer = self.registry.get(identity)
        if peer is not None:
            peer.version = max(peer.version, msg.version)
            self.wake.set()

    def _dead(self, msg: wire.Dead) -> None:
        self.fail(f"role {msg.role}-{msg.rank} died: {msg.cause}")

    def _peer_lost(self, identity: bytes | None) -> None:
        peer = self.registry.get(identity)
        if peer is not None and not self.stopping:
            self.fail(f"role {peer.name} went silent for {self.cfg.transport.peer_timeout_s:g}s")

    # --- rewards ---------------------------------------------------------------------
    async def _score(self, group: Group) -> None:
        rewards = self.registry.of("reward")
        if not rewards:
            raise FatalError("no reward role registered")
        peer = rewards[self.reward_rr % len(rewards)]
        self.reward_rr += 1
        items = [self._reward_item(group, s) for s in group.ordered()]
        timeout = self.cfg.reward.timeout_s * (len(items) + 2)
        try:
            reply = await self.server.request(wire.RewardRequest(items=items), peer=peer.identity, timeout=timeout)
            scores = {s.sample_id: s.reward for s in reply.scores}  # type: ignore[union-attr]
        except (RequestTimeout, RemoteError) as exc:
            log.warning("reward_failed", group=group.gid, error=str(exc))
            scores = {}
        for s in group.ordered():
            s.reward = float(scores.get(group.gid * self.n + s.index, 0.0))
        if self.groups.pop(group.gid, None) is not None:
            self.ready.append(group)
            self.ready_changed.set()

    def _reward_item(self, group: Group, s: SampleRec) -> wire.RewardItem:
        ids = s.token_ids.tolist()
        return wire.RewardItem(
            sample_id=group.gid * self.n + s.index, prompt=group.prompt.text,
            completion=self.tokenizer.decode(ids, skip_special_tokens=True), prompt_ids=group.prompt.prompt_ids,
            completion_ids=ids, answer=group.prompt.answer, metadata=group.prompt.metadata,
        )  # fmt: skip

    # --- training --------------------------------------------------------------------
    async def _take_batch(self) -> list[Group]:
        want = self.cfg.trainer.prompts_per_step
        while True:
            batch: list[Group] = []
            while self.ready and len(batch) < want:
                g = self.ready.popleft()
                if self.gate.is_fresh(g.version):
                    batch.append(g)
                else:
                    self._dropped(g, "dropped_stale", f"version {g.version} at trainer version {self.gate.version}")
            if len(batch) == want:
                return batch
            self.ready.extendleft(reversed(batch))
            self.ready_changed.clear()
            await self.ready_changed.wait()

    def _dropped(self, group: Group, counter: str, why: str) -> None:
        self.groups.pop(group.gid, None)
        self.gate.drop(group.n)
        self.totals[counter] += 1
        self.step_drops[counter] = self.step_drops.get(counter, 0) + group.n
        log.info("group_dropped", group=group.gid, reason=counter, why=why)
        self.wake.set()

    async def _train_step(self) -> None:
        groups = await self._take_batch()
        trainers = self.registry.of("trainer")
        batches, stats = build_train_batches(
            groups, step=self.step, advantage=self.cfg.algorithm.advantage,
            norm_by_std=self.cfg.algorithm.norm_by_std, num_shards=len(trainers),
        )  # fmt: skip
        staleness = [
            self.gate.staleness(int(s.versions.min())) for g in groups for s in g.ordered() if s.versions.numel()
        ]
        timeout = max(600.0, self.cfg.weight_sync.timeout_s * 3)
        replies = await asyncio.gather(
            *[self.server.request(b, peer=t.identity, timeout=timeout) for b, t in zip(batches, trainers, strict=True)]
        )
        result = next(r for r in replies if isinstance(r, wire.TrainResult) and r.metrics)
        self.gate.train(stats.num_samples)
        self.totals["trained_groups"] += len(groups)
        self.step += 1
        self.gate.advance(result.version)
        set_policy_version(result.version)
        self.wake.set()
        self._record(result, stats, staleness)

    def _busy_snapshot(self) -> float:
        rollouts = self.registry.of("rollout")
        return sum(p.clock.busy_s() for p in rollouts) / max(1, len(rollouts))

    def _record(self, result: wire.TrainResult, stats: Any, staleness: list[int]) -> None:
        now = time.monotonic()
        window = max(now - self.last_step_at, 1e-9)
        gen_busy = self._busy_snapshot() - self.last_busy
        m = result.metrics
        train_busy = float(m.get("busy_s", 0.0))
        rec = {
            "step": self.step,
            "policy_version": result.version,
            "reward_mean": stats.reward_mean,
            "reward_std": stats.reward_std,
            "response_len_mean": stats.response_len_mean,
            "staleness_mean": sum(staleness) / max(1, len(staleness)),
            "staleness_max": max(staleness, default=0),
            "dropped_stale": self.step_drops.get("dropped_stale", 0),
            "dropped_stale_total": self.totals["dropped_stale"],
            "dropped_error": self.step_drops.get("dropped_error", 0),
            "samples_per_s": stats.num_samples / window,
            "tokens_per_s": stats.num_response_tokens / window,
            "gen_busy_s": gen_busy,
            "train_busy_s": train_busy,
            "rollout_idle_ratio": max(0.0, 1.0 - gen_busy / window),
            "trainer_idle_ratio": max(0.0, 1.0 - train_busy / window),
            "step_s": window,
            "wall_s": now - self.run_started,
            **{k: m.get(k, 0.0) for k in ("weight_sync_s", "loss", "kl_behaviour_proximal", "importance_weight_max",
                                          "clip_fraction", "entropy", "grad_norm", "lr", "train_s")},
        }  # fmt: skip
        self.metrics.write(rec)
        self.last_step_at, self.last_busy, self.step_drops = now, self._busy_snapshot(), {}

    async def _shutdown_peers(self, reason: str) -> None:
        for p in list(self.registry.peers.values()):
            try:
                await self.server.send(wire.Shutdown(reason=reason), peer=p.identity)
            except Exception:
                pass
        await asyncio.sleep(0.1)

    async def close(self) -> None:
        if hasattr(self, "server"):
            await self.server.aclose()


def _name(identity: bytes | None) -> str:
    return identity.decode(errors="replace") if identity else "?"
