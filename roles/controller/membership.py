"""Who is in the run: registration, rollouts that join or are lost, and what the trainers
and the dispatcher are told when that changes.

A caller may rely on:
* `register` answers every `Register`: `Registered` (the run id, every registered peer,
  the trainer's policy version) or `Error(REFUSED, "registration refused: <why>")` with
  the reason peer_access.py gives. A rollout that registers after `open` (a
  joiner) is welcomed: the trainers get the new rollout list, then it gets the current
  weights.
* `wait_all(timeout_s)` returns once every process placement declares is registered, the
  trainers have the rollout list and every rollout behind the trainer has been brought
  to its version; otherwise FatalError naming what registered and what is needed.
* A rollout of an elastic run that is lost (`Dead`, silence, unreachable, weights not
  delivered) is forgotten once: its unfinished groups go back to the dispatcher, the
  server forgets its identity and the trainers get the rollouts that are left. Any other
  loss ends the run through `host.fail(cause)`; a `Dead` not sent by the role it names
  changes nothing.
* `watch_rollouts` (elastic runs) raises FatalError once no rollout has been registered
  for `elastic_grace_s`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from roles.controller.groups import Group
from roles.controller.peer_access import PeerAccess
from roles.controller.peers import Peer, Registry
from roles.controller.ranks import RankGroup
from runtime.logs import get_logger
from runtime.role import FatalError
from transport import wire
from transport.rpc import RpcEndpoint

log = get_logger("controller")


class Host(Protocol):
    """What membership needs of the role that holds it (`runtime.role.Role` is one)."""

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> object: ...
    def fail(self, cause: str) -> None: ...
    @property
    def stopping(self) -> bool: ...


class Pool(Protocol):
    """What membership needs of the dispatcher (`dispatch.Dispatcher` is one)."""

    def wake(self) -> None: ...
    def lose(self, peer: Peer) -> Sequence[Group]: ...


@dataclass(frozen=True)
class MembershipRules:
    """The run's membership settings, from the config and placement."""

    expected: dict[str, int]  # processes per role kind (runtime/launch/placement.py:role_counts)
    token: str  # the run's secret (runtime/identity/run_token.py)
    elastic: bool = False  # rollout.elastic
    elastic_grace_s: float = 60.0  # rollout.elastic_grace_s
    peer_timeout_s: float = 30.0  # transport.peer_timeout_s (only named in the loss's reason)
    sync_timeout_s: float = 300.0  # bound of one weight sync to lagging rollouts


class Membership:
    def __init__(
        self,
        registry: Registry,
        server: RpcEndpoint,
        trainers: RankGroup,
        pool: Pool,
        rules: MembershipRules,
        *,
        run_id: str,
        version: Callable[[], int],
        host: Host,
    ) -> None:
        """`trainers` get the rollout list and the weight syncs; `pool` takes a lost
        rollout's groups and is woken by every newcomer; `version()` is the trainer's
        current policy version."""
        self.registry = registry
        self.server = server
        self.trainers = trainers
        self.pool = pool
        self.rules = rules
        self.run_id = run_id
        self.version = version
        self.host = host
        self.access = PeerAccess(registry, rules.token, rules.expected, elastic=rules.elastic)
        self.running = False  # after `open`, a registering rollout is a joiner
        self._changed = asyncio.Event()

    def open(self) -> None:
        """Training has begun: from now on a registering rollout is welcomed as a joiner."""
        self.running = True

    # --- registration ------------------------------------------------------------------
    def register(self, identity: bytes | None, msg: wire.Register) -> wire.Message:
        """The reply to `msg` (see the module docstring)."""
        assert identity is not None
        why = self.access.refuse_registration(identity, msg)
        if why is not None:
            return wire.Error(code=wire.ErrorCode.REFUSED, message=f"registration refused: {why}")
        peer = self.registry.add(identity, msg.peer)
        log.info("registered", peer=peer.name, address=msg.peer.address, version=msg.peer.version, pid=msg.pid)
        self._changed.set()
        if self.running and peer.info.role == "rollout":
            log.info("worker_joined", peer=peer.name, version=peer.version, trainer_version=self.version())
            self.host.spawn(f"join-{peer.name}", self._welcome())
        self.pool.wake()
        peers = [p.info for p in self.registry.peers.values()]
        return wire.Registered(run_id=self.run_id, peers=peers, policy_version=self.version())

    async def wait_all(self, timeout_s: float) -> None:
        """Until every declared process is registered (see the module docstring)."""
        deadline = time.monotonic() + timeout_s
        while not self.all_registered():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                have = {k: self.registry.count(k) for k in self.rules.expected}
                raise FatalError(f"roles did not register in {timeout_s:g}s: have {have}, need {self.rules.expected}")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                continue
        await self._welcome()
        log.info("all_registered", peers=[p.name for p in self.registry.peers.values()])

    def all_registered(self) -> bool:
        """Every role kind but the controller has its declared number of live processes."""
        return all(self.registry.count(k) >= n for k, n in self.rules.expected.items() if k != "controller")

    async def _welcome(self) -> None:
        """Tell the trainers the rollouts, then bring the lagging ones (resumed without
        weights, or new) to the trainer's version."""
        await self.send_rollouts()
        lagging = [p.info for p in self.registry.of("rollout") if p.version < self.version()]
        if not lagging:
            return
        log.info("syncing_rollouts", rollouts=[f"{i.role}-{i.rank}" for i in lagging], version=self.version())
        await self.trainers.call(wire.SyncWeights(rollouts=lagging), self.rules.sync_timeout_s)

    async def send_rollouts(self) -> None:
        """Every trainer rank gets the live rollouts (`Peers`)."""
        msg = wire.Peers(role="rollout", peers=[p.info for p in self.registry.of("rollout")])
        for t in self.registry.of("trainer"):
            await self.server.send(msg, peer=t.identity)

    # --- losses --------------------------------------------------------------------------
    def dead(self, identity: bytes | None, msg: wire.Dead) -> None:
        """A role's `Dead` notice: a lost rollout (elastic) or the end of the run."""
        if not self.access.believe_dead(identity, msg):
            return
        peer = self.registry.get(identity)
        if msg.role == "rollout" and self.rules.elastic and peer is not None:
            self.lose_rollout(peer, f"died: {msg.cause}")
        else:
            self.host.fail(f"role {msg.role}-{msg.rank} died: {msg.cause}")

    def peer_lost(self, identity: bytes | None) -> None:
        """The server's report of a peer silent for `peer_timeout_s` (ignored while stopping)."""
        peer = self.registry.get(identity)
        if peer is None or self.host.stopping or not peer.alive:
            return
        why = f"silent for {self.rules.peer_timeout_s:g}s"
        if peer.info.role == "rollout" and self.rules.elastic:
            self.lose_rollout(peer, why)
        else:
            self.host.fail(f"role {peer.name} went {why}")

    def unreachable(self, peer: Peer, why: str) -> None:
        """A send to `peer` failed (the dispatcher's report)."""
        self.rollout_failed(peer.name, why)

    def rollout_failed(self, name: str, why: str) -> None:
        """The live rollout `name` failed: lost when elastic, else the run ends."""
        peer = next((p for p in self.registry.of("rollout") if p.name == name), None)
        if peer is None:
            return
        if self.rules.elastic:
            self.lose_rollout(peer, why)
        else:
            self.host.fail(f"rollout {name}: {why}")

    def lose_rollout(self, peer: Peer, why: str) -> None:
        """Forget a rollout worker and hand its unfinished groups to the survivors."""
        moved = self.pool.lose(peer)
        self.server.forget(peer.identity)
        uids = [g.prompt.uid for g in moved]
        log.warning("worker_lost", peer=peer.name, reason=why, redispatch=len(moved), uids=uids)
        self.host.spawn(f"lost-{peer.name}-{time.monotonic():.3f}", self.send_rollouts())

    async def watch_rollouts(self, poll_s: float = 1.0) -> None:
        """Raise FatalError once no rollout has been registered for `elastic_grace_s`."""
        empty_since: float | None = None
        while True:
            await asyncio.sleep(poll_s)
            if self.registry.of("rollout"):
                empty_since = None
                continue
            empty_since = empty_since or time.monotonic()
            if time.monotonic() - empty_since > self.rules.elastic_grace_s:
                raise FatalError(f"no rollout worker for {self.rules.elastic_grace_s:g}s")

    async def shutdown_all(self, reason: str) -> None:
        """Send every registered peer `Shutdown` (a peer that is gone is skipped)."""
        for p in list(self.registry.peers.values()):
            try:
                await self.server.send(wire.Shutdown(reason=reason), peer=p.identity)
            except Exception:  # a peer that is gone needs no shutdown
                pass
        await asyncio.sleep(0.1)
