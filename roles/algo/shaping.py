"""Reward shaping from response lengths.

Invariant: a pure function of (length, limits): 0 for responses that end `buffer` tokens or
more before `max_tokens`, linear down to `-penalty` at `max_tokens`, never positive.
"""

from __future__ import annotations


def overlong_penalty(length: int, *, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): ((max - buffer) - length) /
    buffer * penalty inside the last `buffer` tokens, -penalty at or past `max_tokens`."""
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    if length >= max_tokens or buffer <= 0:
        return -penalty
    return (start - length) / buffer * penalty
