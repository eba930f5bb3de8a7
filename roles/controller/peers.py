"""The controller's view of registered roles: identity, info, version, load, busy time."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transport.wire import PeerInfo


@dataclass
class BusyClock:
    """Accumulates the time during which at least one unit of work is outstanding."""

    active: int = 0
    since: float = 0.0
    total: float = 0.0

    def add(self, n: int = 1) -> None:
        if self.active == 0 and n > 0:
            self.since = time.monotonic()
        self.active += n

    def done(self, n: int = 1) -> None:
        self.active = max(0, self.active - n)
        if self.active == 0:
            self.total += time.monotonic() - self.since

    def busy_s(self) -> float:
        extra = time.monotonic() - self.since if self.active else 0.0
        return self.total + extra


@dataclass
class Peer:
    identity: bytes
    info: PeerInfo
    version: int = 0
    in_flight: int = 0  # samples (rollout) or requests (others) outstanding
    served: int = 0  # samples completed (rollout)
    clock: BusyClock = field(default_factory=BusyClock)
    alive: bool = True

    @property
    def name(self) -> str:
        return f"{self.info.role}-{self.info.rank}"


class Registry:
    def __init__(self) -> None:
        self.peers: dict[bytes, Peer] = {}

    def add(self, identity: bytes, info: PeerInfo) -> Peer:
        peer = Peer(identity=identity, info=info, version=info.version)
        self.peers[identity] = peer
        return peer

    def of(self, role: str) -> list[Peer]:
        """Live peers of one kind, by rank."""
        return sorted((p for p in self.peers.values() if p.info.role == role and p.alive), key=lambda p: p.info.rank)

    def count(self, role: str) -> int:
        return len(self.of(role))

    def get(self, identity: bytes | None) -> Peer | None:
        return self.peers.get(identity) if identity is not None else None
