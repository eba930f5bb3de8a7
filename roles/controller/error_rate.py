"""The run's bound on failed sampling: the environment's (and the agent's, and the
generation's) equivalent of `reward.max_failure_fraction`.

A group whose sample failed is dropped (`dropped_error`) and the run goes on; `ErrorRate`
watches the last `window` groups that finished sampling. What a caller may rely on:
`record(error)` ("" for a group that sampled cleanly) returns "" while at most
`max_fraction` of a full window failed, else one line naming the count, the setting and
the first error of the window, the cause the run ends with. A window not yet full never
ends the run, so a few failures at the start cost only their groups.
"""

from __future__ import annotations

from collections import deque


class ErrorRate:
    def __init__(self, max_fraction: float, window: int) -> None:
        self.max_fraction = max_fraction
        self.window = max(1, window)
        self._last: deque[str] = deque(maxlen=self.window)

    def record(self, error: str) -> str:
        """Count one group that finished sampling; the cause to end the run with, or ""."""
        self._last.append(error)
        failed = [e for e in self._last if e]
        if len(self._last) < self.window or len(failed) <= self.max_fraction * self.window:
            return ""
        return (
            f"{len(failed)} of the last {self.window} prompt groups failed sampling (more than "
            f"rollout.max_error_fraction={self.max_fraction:g}); first: {failed[0]}"
        )
