"""Who may join the run and speak for a role: the controller's checks of control messages.

A caller may rely on:
* `refuse_registration` returns why a `Register` must be refused, or None: the run's
  secret must be presented (runtime/identity/run_token.py), the role kind must be one placement
  declares, its rank one of that kind's ranks (rollouts of an elastic run may also take a
  joiner's rank, 1000 and up), and no live peer may hold that identity or that role and
  rank already.
* `believe_dead` is True only for a `Dead` sent by the very identity registered for the
  role and rank it names.
* Every refusal is counted in `refused` by kind; the first few of each are logged.
"""

from __future__ import annotations

from collections import Counter

from roles.controller.peers import Registry
from runtime.identity.run_token import matches
from runtime.logs import get_logger
from transport import wire

log = get_logger("controller")
JOINER_RANKS = 1000  # runtime/launch/placement.py:plan_join numbers joiners from here
LOG_FIRST = 5


class PeerAccess:
    def __init__(self, registry: Registry, token: str, declared: dict[str, int], *, elastic: bool) -> None:
        """`declared`: processes per role kind, as placement has them (runtime/launch/placement.py:role_counts)."""
        self.registry = registry
        self.token = token
        self.declared = declared
        self.elastic = elastic
        self.refused: Counter[str] = Counter()

    def refuse_registration(self, identity: bytes, msg: wire.Register) -> str | None:
        info = msg.peer
        why = None
        if not matches(msg.token, self.token):
            why = "no valid run token"
        elif info.role not in self.declared or info.role == "controller":
            why = f"role {info.role!r} is not in this run's placement ({', '.join(sorted(self.declared))})"
        elif not self._rank_declared(info.role, info.rank):
            why = f"{info.role} rank {info.rank} is not in this run's placement ({self.declared[info.role]} ranks)"
        elif (held := self.registry.get(identity)) is not None and held.alive:
            why = f"identity {identity.decode(errors='replace')} is already registered"
        elif any(p.info.rank == info.rank for p in self.registry.of(info.role)):
            why = f"{info.role}-{info.rank} is already registered"
        if why is not None:
            self._count("registration", why, identity)
        return why

    def believe_dead(self, identity: bytes | None, msg: wire.Dead) -> bool:
        peer = self.registry.get(identity)
        if peer is not None and (peer.info.role, peer.info.rank) == (msg.role, msg.rank):
            return True
        self._count("dead", f"Dead for {msg.role}-{msg.rank} not sent by it", identity)
        return False

    def _rank_declared(self, role: str, rank: int) -> bool:
        return 0 <= rank < self.declared[role] or (role == "rollout" and self.elastic and rank >= JOINER_RANKS)

    def _count(self, kind: str, why: str, identity: bytes | None) -> None:
        self.refused[kind] += 1
        if self.refused[kind] <= LOG_FIRST:
            peer = identity.decode(errors="replace") if identity else "?"
            log.warning("control_message_refused", kind=kind, peer=peer, reason=why, refused=self.refused[kind])
