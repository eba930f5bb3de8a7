"""Seeds derived from a run's seed: what a seeded run draws is a pure function of its labelled
parts, never of timing or order.

`derived_seed(label, *parts)` is 48 bits, so a caller may add a small index (vLLM adds the
sample's index to a request's seed) and stay within a torch generator's seed; different
labels or parts give unrelated seeds."""

from __future__ import annotations

import random


def derived_seed(label: str, *parts: int) -> int:
    """The 48-bit seed of `label` and `parts` (the same in every process and run)."""
    return random.Random(":".join([label, *map(str, parts)])).getrandbits(48)
