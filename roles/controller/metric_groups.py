"""Grouped metric names for the dashboards (TensorBoard, wandb), as verl and TRL users
expect them: `actor/`, `critic/`, `rollout/`, `timing/`, `weights/`, `val/`.

`grouped(key)` is the name a step metric gets in TensorBoard and wandb: the group, a
slash, and the flat key as `metrics.jsonl` keeps it (`loss` → `actor/loss`,
`reward_mean` → `rollout/reward_mean`), except that a critic metric drops its `critic_`
prefix (`critic_value_loss` → `critic/value_loss`). A name that already has a group
(`val/...`) is kept. `metrics.jsonl` keeps the flat names: scripts, benchmarks and
`tandem report` read them. The rules, first match wins, are `RULES`; docs/metrics.md
prints them (`rules_table`).
"""

from __future__ import annotations

import re

RULES: tuple[tuple[str, str, str], ...] = (
    # (group, regular expression on the flat key, what it covers)
    ("critic", r"critic_.*", "the critic's loss, values, grad norm, timing"),
    ("weights", r"weight_sync.*|weights_.*", "weight updates: time, phases, bytes"),
    (
        "rollout",
        r"(reward|response_len|staleness|dropped|turns|env_tokens|tool|sample_errors|prompts)(_.*)?",
        "rewards, lengths, staleness, dropped groups and prompts, multi-turn counts",
    ),
    ("timing", r".*_s|.*_per_s|.*_idle_ratio", "throughput, busy and idle time, step and wall time"),
    ("actor", r".*", "everything else: loss, entropy, KL, clipping, grad norm, lr, memory, policy version"),
)
_COMPILED = tuple((group, re.compile(pattern)) for group, pattern, _ in RULES)


def grouped(key: str) -> str:
    """The dashboard name of flat metric `key` (see the module docstring)."""
    if "/" in key:
        return key
    for group, pattern in _COMPILED:
        if pattern.fullmatch(key):
            return f"{group}/{key.removeprefix('critic_') if group == 'critic' else key}"
    raise AssertionError("the last rule matches every key")


def rules_table() -> str:
    """The rules as a markdown table (docs/metrics.md)."""
    rows = ["| group | flat keys (regular expression, first match wins) | what |", "| --- | --- | --- |"]
    rows += [f"| `{g}/` | `{p.replace('|', chr(92) + '|')}` | {what} |" for g, p, what in RULES]
    return "\n".join(rows)
