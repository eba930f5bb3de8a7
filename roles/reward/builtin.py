"""Built-in reward functions (`roles.reward.builtin:NAME` in `reward.functions`).

A reward function takes any of the keyword arguments `prompt`, `completion`, `answer`,
`metadata`, `prompt_ids`, `completion_ids` (only those it names are passed) and returns
a float. It may be `async`.
"""

from __future__ import annotations

import re

_NUMBER = r"-?[\d,]*\.?\d+"


def copy_task(completion_ids: list[int], answer: str | None = None, **_: object) -> float:
    """The synthetic task of the tiny run: the fraction of response tokens that are letters
    of the prompt (`answer` holds the prompt's letters; the tiny tokenizer's ids are bytes)."""
    if not completion_ids:
        return 0.0
    allowed = {ord(c) for c in (answer or "")}
    return sum(1 for t in completion_ids if t in allowed) / len(completion_ids)


def extract_answer(text: str) -> str | None:
    """The final answer of a GSM8K-style solution: after `####`, else the last `\\boxed{}`."""
    m = re.search(r"####\s*(" + _NUMBER + ")", text)
    if m is None:
        boxed = re.findall(r"\\boxed\{\s*(" + _NUMBER + r")\s*\}", text)
        if not boxed:
            return None
        value = boxed[-1]
    else:
        value = m.group(1)
    return _normalise(value)


def _normalise(value: str) -> str:
    value = value.replace(",", "").strip()
    if "." in value:
        value = value.rstrip("0").rstrip(".")
    return value


def gsm8k_exact_match(completion: str, answer: str | None = None, **_: object) -> float:
    """1.0 when the completion's final answer equals the reference's, else 0.0.

    The reference may be a bare number or a full GSM8K solution ending in `#### N`."""
    if answer is None:
        return 0.0
    ref = extract_answer(str(answer)) or _normalise(str(answer))
    got = extract_answer(completion)
    return 1.0 if got is not None and got == ref else 0.0
