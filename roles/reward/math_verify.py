"""A math reward built on HuggingFace's `math-verify` (`roles.reward.math_verify:math_equal`),
beside the GSM8K exact match of roles/reward/builtin.py (the `math` extra installs it).

`math_equal` parses the completion's answer (its last `\\boxed{}`, else the last LaTeX or
plain expression math-verify finds) and the reference (a bare value, LaTeX, or a GSM8K
solution ending in `#### N`), and scores 1.0 when math-verify finds them equal (so
`\\frac{1}{2}`, `0.5` and `1/2` match, as do equal sets and intervals), else 0.0. A parse that
finds nothing, or that math-verify cannot settle within its time limit, scores 0.0.

math-verify (and sympy, its LaTeX grammar) is imported and exercised once when this module
is imported, so a reward worker pays it while it starts (workers.py), never inside a call's
`reward.timeout_s`: sixteen workers importing it at once on a loaded 2-core machine took
11-15 s, over the default timeout.
"""

from __future__ import annotations

from typing import Any

from math_verify import parse, verify

from roles.reward.builtin import extract_answer


def math_equal(completion: str, answer: Any = None, **_: object) -> float:
    if answer is None:
        return 0.0
    reference = str(answer)
    if "####" in reference:
        reference = extract_answer(reference) or reference
    gold = parse(reference if "$" in reference or "\\" in reference else f"${reference}$")
    got = parse(completion)
    if not gold or not got:
        return 0.0
    try:
        return 1.0 if verify(gold, got) else 0.0
    except Exception:  # math-verify's own failures (sympy on odd input): not equal
        return 0.0


math_equal("\\boxed{\\frac{1}{2}}", "0.5")  # the parsers' lazy set-up, at import rather than in the first call
