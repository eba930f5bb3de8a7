"""The weight path's errors, shared by both sides."""

from __future__ import annotations

from runtime.errors import TandemError


class WeightSyncError(TandemError, RuntimeError):
    """An update that did not reach one rollout: which one, in which phase, and why."""

    def __init__(self, rollout: str, phase: str, cause: str) -> None:
        super().__init__(f"weight sync to {rollout} failed in phase '{phase}': {cause}")
        self.rollout = rollout
        self.phase = phase


class StaleUpdate(TandemError, ValueError):
    """A weight update for an older version than the rollout's."""
