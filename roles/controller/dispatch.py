"""Dispatch: admit prompts through the ledger, send them to rollouts, collect their samples.

What a caller may rely on:
* A group goes to the least-loaded live rollout whose weights are fresh enough for the
  gate (version ≥ trainer version − max_staleness) and that has room for its n samples.
  Groups waiting for re-dispatch go before new prompts.
* `on_completion` accepts each sample once, from the rollout the group was sent to, and
  returns the group when its last sample arrived; anything else is ignored and logged.
* `lose(peer)` hands the rollout's unfinished groups back to the ledger (`requeue`), so
  the survivors generate them again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from roles.controller.dataset import PromptDataset
from roles.controller.groups import Group, SampleRec
from roles.controller.ledger import Ledger
from roles.controller.peers import Peer, Registry
from runtime.logs import get_logger
from transport import wire
from transport.rpc import PeerUnreachable, RpcEndpoint

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
    ) -> None:
        """`on_unreachable(peer, why)`: a rollout a send could not reach."""
        self.ledger = ledger
        self.dataset = dataset
        self.registry = registry
        self.server = server
        self.sampling = sampling
        self.max_num_seqs = max_num_seqs
        self.on_unreachable = on_unreachable
        self._wake = asyncio.Event()
        ledger.on_change(self.wake)

    def wake(self) -> None:
        """Look again for work to send (a rollout freed up, or the gate opened)."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._dispatch_ready()

    async def _dispatch_ready(self) -> None:
        while self.ledger.redo and (rollout := self._pick_rollout()) is not None:
            group = self.ledger.next_redo()
            assert group is not None
            await self._send(rollout, group)
            log.info("redispatched", group=group.gid, uid=group.prompt.uid, to=rollout.name, attempt=group.attempts)
        while self.ledger.can_admit() and (rollout := self._pick_rollout()) is not None:
            await self._send(rollout, self.ledger.admit(self.dataset.next()))

    def _pick_rollout(self) -> Peer | None:
        floor = self.ledger.version - self.ledger.max_staleness
        n = self.ledger.group_size
        ok = [p for p in self.registry.of("rollout") if p.version >= floor and p.in_flight + n <= self.max_num_seqs]
        return min(ok, key=lambda p: p.in_flight) if ok else None

    async def _send(self, rollout: Peer, group: Group) -> None:
        group.rollout = rollout.identity
        group.dispatched_at = time.monotonic()
        rollout.in_flight += group.n
        rollout.clock.add(group.n)
        msg = wire.Generate(
            request_id=group.request_id, group_id=group.gid, prompt_ids=group.prompt.prompt_ids, sampling=self.sampling
        )
        try:
            await self.server.send(msg, peer=rollout.identity)
        except PeerUnreachable as exc:
            # Gone before its heartbeat ran out, or no longer reading; elastic runs hand this
            # group (and the rest of the worker's) to the survivors.
            self.on_unreachable(rollout, str(exc))

    def on_completion(self, identity: bytes | None, msg: wire.Completion) -> Group | None:
        """Record one sample; the group once all its samples are in."""
        group = self.ledger.group(msg.group_id)
        if group is None or group.rollout != identity or msg.sample_index in group.samples:
            log.warning("completion_ignored", group=msg.group_id, sample=msg.sample_index, peer=_name(identity))
            return None
        rollout = self.registry.get(identity)
        if rollout is not None:
            rollout.in_flight -= 1
            rollout.served += 1
            rollout.clock.done()
        group.samples[msg.sample_index] = SampleRec(
            index=msg.sample_index, token_ids=msg.token_ids.clone(), logprobs=msg.logprobs.clone(),
            versions=msg.versions.clone(), finish_reason=msg.finish_reason, error=msg.error,
        )  # fmt: skip
        self.wake()
        return group if group.complete else None

    def lose(self, peer: Peer) -> list[Group]:
        """Forget a rollout; its unfinished groups wait for re-dispatch. Returns them."""
        peer.alive = False
        moved = [g for g in list(self.ledger.in_flight.values()) if g.rollout == peer.identity and not g.complete]
        for g in moved:
            self.ledger.requeue(g)
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
