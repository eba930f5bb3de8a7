"""Dispatch: admit prompts through the ledger, send them to rollouts, collect their samples.

What a caller may rely on:
* A group goes to the least-loaded live rollout whose weights are fresh enough for the
  gate (version ≥ trainer version − max_staleness) and that has room for its n samples.
  Groups waiting for re-dispatch go before new prompts.
* `on_completion` accepts each sample once, from the rollout the group was sent to, and
  returns the group when its last sample arrived; anything else is ignored and logged.
* `lose(peer)` hands the rollout's unfinished groups back to the ledger (`requeue`), so
  the survivors generate them again.
* Side groups (`submit_side`: validation) have negative ids and never meet the ledger:
  they go after re-dispatches and before new prompts, with their own sampling, and each
  goes to `on_side_done` once all its samples are in; a lost rollout's unfinished side
  groups are sent again; `cancel_side` forgets them (later samples are ignored).
* Every send is written to the schedule log (`dispatch`), and so is every group whose
  samples are all in (`sampled`: generation span, the versions of its tokens).
* With a `sample_seed`, every group (side groups too) carries the seed `group_seed` gives
  it, the same at every dispatch; the rollout draws sample i with that seed + i.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable

import msgspec

from roles.controller.budgets import Budget
from roles.controller.dataset import PromptDataset
from roles.controller.groups import Group, SampleRec
from roles.controller.ledger import Ledger
from roles.controller.peers import Peer, Registry
from roles.controller.schedule import NoSchedule, ScheduleLog
from runtime.logs import get_logger
from runtime.seeds import derived_seed
from transport import wire
from transport.rpc import PeerUnreachable, RpcEndpoint
from transport.throttle import Throttled

log = get_logger("controller")


class Dispatcher:
    def __init__(
        self,
        ledger: Ledger,
        dataset: PromptDataset,
        registry: Registry,
        server: RpcEndpoint,
        sampling: wire.SamplingSpec,
        *,
        max_num_seqs: int,
        on_unreachable: Callable[[Peer, str], None],
        schedule: ScheduleLog | None = None,
        budget: Budget | None = None,
        sample_seed: int | None = None,
    ) -> None:
        """`on_unreachable(peer, why)`: a rollout a send could not reach; `schedule`: where
        dispatches and finished sampling are recorded; `budget`: each training group's
        max_tokens by group id (roles/controller/budgets.py; None: `sampling.max_tokens`);
        `sample_seed`: None leaves vLLM's sampling unseeded, an int seeds every group
        (`group_seed`), a re-dispatched one with the seed it had."""
        self.budget = budget
        self.sample_seed = sample_seed
        self.noisy = Throttled(log)
        self.schedule = schedule if schedule is not None else NoSchedule()
        self.ledger = ledger
        self.dataset = dataset
        self.registry = registry
        self.server = server
        self.sampling = sampling
        self.max_num_seqs = max_num_seqs
        self.on_unreachable = on_unreachable
        self._wake = asyncio.Event()
        self.side: deque[Group] = deque()  # side groups waiting to be sent
        self.side_groups: dict[int, Group] = {}  # every side group not yet done, by gid
        self.on_side_done: Callable[[Group], None] = lambda group: None
        ledger.on_change(self.wake)

    def submit_side(self, groups: Iterable[Group]) -> None:
        """Queue side groups (negative `gid`, each with its own `sampling`)."""
        for g in groups:
            assert g.gid < 0 and g.sampling is not None, "a side group has a negative id and its own sampling"
            self.side.append(g)
            self.side_groups[g.gid] = g
        self.wake()

    def cancel_side(self, gids: Iterable[int]) -> None:
        """Forget these side groups: unsent ones are not sent, later samples are ignored."""
        gone = set(gids)
        waiting = {g.gid for g in self.side}
        for gid in gone:
            group = self.side_groups.pop(gid, None)
            if group is None or gid in waiting or not group.rollout:
                continue
            rollout = self.registry.get(group.rollout)
            if rollout is not None:  # its samples still to come no longer hold the rollout's room
                left = group.n - len(group.samples)
                rollout.in_flight -= left
                rollout.clock.done(left)
        self.side = deque(g for g in self.side if g.gid not in gone)
        self.wake()

    def wake(self) -> None:
        """Look again for work to send (a rollout freed up, or the gate opened)."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._dispatch_ready()

    async def _dispatch_ready(self) -> None:
        while self.ledger.has_redo and (rollout := self._pick_rollout()) is not None:
            group = self.ledger.next_redo()
            assert group is not None
            await self._send(rollout, group)
            log.info("redispatched", group=group.gid, uid=group.prompt.uid, to=rollout.name, attempt=group.attempts)
        while self.side and (rollout := self._pick_rollout(self.side[0].n)) is not None:
            await self._send(rollout, self.side.popleft())
        while self.ledger.can_admit() and (rollout := self._pick_rollout()) is not None:
            await self._send(rollout, self.ledger.admit(self.dataset.next()))

    def _pick_rollout(self, n: int = 0) -> Peer | None:
        floor = self.ledger.version - self.ledger.max_staleness
        n = n or self.ledger.group_size
        ok = [p for p in self.registry.of("rollout") if p.version >= floor and p.in_flight + n <= self.max_num_seqs]
        return min(ok, key=lambda p: p.in_flight) if ok else None

    async def _send(self, rollout: Peer, group: Group) -> None:
        group.rollout = rollout.identity
        group.dispatched_at = time.time()
        rollout.in_flight += group.n
        rollout.clock.add(group.n)
        self.schedule.dispatch(group.gid, rollout.name, group.attempts)
        sampling = group.sampling or self._training_sampling(group.gid)
        if self.sample_seed is not None:
            sampling = msgspec.structs.replace(sampling, seed=group_seed(self.sample_seed, group.gid))
        prompt = group.prompt
        msg = wire.Generate(
            request_id=group.request_id,
            group_id=group.gid,
            prompt_ids=prompt.prompt_ids,
            sampling=sampling,
            answer=prompt.answer,
            metadata=prompt.metadata,
        )
        try:
            await self.server.send(msg, peer=rollout.identity)
        except PeerUnreachable as exc:
            # Gone before its heartbeat ran out, or no longer reading; elastic runs hand this
            # group (and the rest of the worker's) to the survivors.
            self.on_unreachable(rollout, str(exc))

    def _training_sampling(self, gid: int) -> wire.SamplingSpec:
        if self.budget is None:
            return self.sampling
        return msgspec.structs.replace(self.sampling, max_tokens=self.budget(gid))

    def on_completion(self, identity: bytes | None, msg: wire.Completion) -> Group | None:
        """Record one sample; the group once all its samples are in."""
        side = msg.group_id < 0
        group = self.side_groups.get(msg.group_id) if side else self.ledger.group(msg.group_id)
        if group is None or group.rollout != identity or msg.sample_index in group.samples:
            self.noisy.warning("completion_ignored", group=msg.group_id, sample=msg.sample_index, peer=_name(identity))
            return None
        rollout = self.registry.get(identity)
        if rollout is not None:
            rollout.in_flight -= 1
            rollout.served += 1
            rollout.clock.done()
        group.samples[msg.sample_index] = SampleRec(
            index=msg.sample_index,
            token_ids=msg.token_ids.clone(),
            logprobs=msg.logprobs.clone(),
            versions=msg.versions.clone(),
            finish_reason=msg.finish_reason,
            error=msg.error,
            loss_mask=None if msg.loss_mask is None else msg.loss_mask.clone(),
            env_reward=msg.env_reward,
            num_turns=msg.num_turns,
            routed_experts=None if msg.routed_experts is None else msg.routed_experts.clone(),
        )
        now = time.time()
        group.first_arrival = group.first_arrival or now
        group.last_arrival = now
        started = now - msg.gen_s
        group.gen_started = min(group.gen_started, started) if group.gen_started else started
        self.wake()
        if group.complete:
            self._record_sampled(group, rollout.name if rollout is not None else _name(identity))
        if side:
            if group.complete:
                del self.side_groups[group.gid]
                self.on_side_done(group)
            return None
        return group if group.complete else None

    def _record_sampled(self, group: Group, rollout: str) -> None:
        vmin, vmax = group.token_versions or (group.admitted_version, group.admitted_version)
        tokens = sum(s.length for s in group.samples.values())
        self.schedule.sampled(group.gid, rollout, group.gen_started, vmin, vmax, tokens)

    def _sent_side(self, peer: Peer) -> list[Group]:
        """Side groups sent to `peer` and not complete."""
        waiting = {g.gid for g in self.side}
        return [
            g
            for g in self.side_groups.values()
            if g.rollout == peer.identity and not g.complete and g.gid not in waiting
        ]

    def lose(self, peer: Peer) -> list[Group]:
        """Forget a rollout; its unfinished groups wait for re-dispatch. Returns them
        (the ledger's; its side groups are queued again, too)."""
        peer.alive = False
        for g in self._sent_side(peer):
            g.forget_generation()
            self.side.appendleft(g)
        moved = self.ledger.requeue_lost(peer.identity)
        peer.clock.done(peer.in_flight)
        peer.in_flight = 0
        self.wake()
        return moved

    def gen_busy_s(self) -> float:
        """Time rollouts had samples in flight, mean over the live rollouts."""
        rollouts = self.registry.of("rollout")
        return sum(p.clock.busy_s() for p in rollouts) / max(1, len(rollouts))


def _name(identity: bytes | None) -> str:
    return identity.decode(errors="replace") if identity else "?"


def group_seed(run_seed: int, gid: int) -> int:
    """The sampling seed of group `gid` in a run seeded `run_seed`: a pure function of the
    two, 48 bits (vLLM adds the sample's index), unrelated for neighbouring groups."""
    return derived_seed("sampling", run_seed, gid)
