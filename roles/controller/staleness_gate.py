"""The staleness gate of async PPO (as in AReaL), as pure bookkeeping.

Invariant a caller may rely on: if every sample is checked with `is_fresh` right
before it is trained, and dropped (`drop`) when it is not, then no sample is trained
more than `max_staleness` versions after the oldest token it holds was generated.

Admission keeps the drop rate low: with trainer version `v`, the samples admitted and
not dropped never exceed `(v + max_staleness + 1) * batch_size`. Dropped samples give
their slots back, so drops can never stall the run. `max_staleness = 0` admits exactly
one batch per version: synchronous on-policy PPO through the same code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StalenessGate:
    batch_size: int
    max_staleness: int
    version: int = 0
    admitted: int = 0
    dropped: int = 0
    trained: int = 0

    def capacity(self) -> int:
        """Samples that may still be admitted at the current version."""
        limit = (self.version + self.max_staleness + 1) * self.batch_size
        return limit - (self.admitted - self.dropped)

    def can_admit(self, n: int) -> bool:
        return self.capacity() >= n

    def admit(self, n: int) -> None:
        if not self.can_admit(n):
            raise ValueError(f"gate: {n} samples exceed the capacity {self.capacity()} at version {self.version}")
        self.admitted += n

    def is_fresh(self, sample_version: int) -> bool:
        """May a sample whose oldest token has `sample_version` be trained at `version`?"""
        return self.version - sample_version <= self.max_staleness

    def staleness(self, sample_version: int) -> int:
        return self.version - sample_version

    def drop(self, n: int) -> None:
        self.dropped += n

    def train(self, n: int) -> None:
        self.trained += n

    def advance(self, version: int) -> None:
        """The trainer published `version` (versions only go up)."""
        if version < self.version:
            raise ValueError(f"gate: version went back from {self.version} to {version}")
        self.version = version

    def in_flight(self) -> int:
        """Admitted samples neither trained nor dropped yet."""
        return self.admitted - self.dropped - self.trained

    def state(self) -> dict[str, int]:
        return {"version": self.version, "admitted": self.admitted, "dropped": self.dropped, "trained": self.trained}

    def restore(self, state: dict[str, int]) -> None:
        """Take back the counters `state()` returned."""
        self.version, self.admitted = state["version"], state["admitted"]
        self.dropped, self.trained = state["dropped"], state["trained"]
