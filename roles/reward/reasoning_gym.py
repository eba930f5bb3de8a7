"""reasoning-gym's own scorers as a reward (`roles.reward.reasoning_gym:score`), for
`data.source: reasoning_gym` (runtime/data/task_sources.py puts what they need in each row).

The reply's answer is what its last `<answer>...</answer>` holds (reasoning-gym's
`extract_answer`, the format its `default` system prompt asks for); a reply without one
scores 0.0. The answer is scored by the task's own `score_answer` (for a `composite`
task, the scorer of the task the row came from) against the row's entry as
reasoning-gym made it: question, answer and metadata.

reasoning-gym is imported with this module (4 s of CPU: it registers every dataset), so a
reward worker pays it while it starts, never inside a call's `reward.timeout_s`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from reasoning_gym import get_score_answer_fn
from reasoning_gym.utils import extract_answer


def score(completion: str, answer: Any = None, metadata: dict[str, Any] | None = None, **_: object) -> float:
    row = (metadata or {}).get("reasoning_gym")
    if not row:
        raise ValueError("the row has no reasoning_gym entry (data.source=reasoning_gym makes it)")
    reply = extract_answer(completion)
    if reply is None:
        return 0.0
    entry = {"question": row.get("question", ""), "answer": answer, "metadata": row.get("entry", {})}
    return float(_scorer(row["dataset"])(answer=reply, entry=entry))


@functools.cache
def _scorer(dataset: str) -> Callable[..., float]:
    return get_score_answer_fn(dataset)
