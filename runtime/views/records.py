"""The boundary check of the records a run writes, as `tandem report` and `tandem watch`
read them back (metrics.jsonl, schedule.jsonl): a record they use has the types its
writers give it (runtime/views/report, runtime/views/watch_state.py trust what passes).

What a caller may rely on: `usable_metrics(rec)` / `usable_schedule(rec)` is False for a
record that is not a dict or has a field of the wrong type (a `"t0": "yesterday"`, a
`"reward_mean": "high"`, a `step` record's `phases` other than `[phase, from, to]` lists),
or lacks a field it needs (a metrics record its `step`, a schedule record what its event
needs); `skipped_warning` is the one line that says how many lines were left out of a
file and why.

A metric that is NaN or infinite is a value, not a damaged record, however the writer put it:
as a JSON number (`NaN`, `Infinity`: Python's json), as `null` (msgspec writes NaN so), or as
the text `"nan"`, `"inf"`, `"-inf"`. `metric(rec, key)` gives it back as a float (`null` is NaN),
which formats as `nan` / `inf`, so every reader shows it without a special case.
"""

from __future__ import annotations

import math
from typing import Any

METRICS_TEXT = frozenset({"kind"})  # every other metrics field is a number or a bool
NON_FINITE_TEXT = frozenset({"nan", "-nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"})
SCHEDULE_TEXT = frozenset({"ev", "to", "why", "detail"})  # every other field is a number
# What each schedule event needs (roles/controller/schedule.py writes them).
SCHEDULE_NEEDS = {
    "dispatch": ("g", "t", "to"),
    "sampled": ("g", "t", "t0", "to", "vmin", "vmax", "tok"),
    "admit": ("g",),
    "requeue": ("g",),
    "drop": ("g", "why"),
    "step": ("t", "t0", "step", "version", "groups"),
    "sync": ("t", "t0", "to", "version", "receive_s", "load_s"),
    "val": ("t", "t0", "step", "version", "groups"),
}


def usable_metrics(rec: Any) -> bool:
    if not isinstance(rec, dict):
        return False
    if not _integer(rec.get("step")):
        return False
    return all(isinstance(v, str) if k in METRICS_TEXT else _metric_value(v) for k, v in rec.items())


def metric(rec: dict[str, Any], key: str, default: float = 0.0) -> float:
    """`rec[key]` as a number (an int stays an int); NaN and ±inf however they were written
    (see the module docstring); `default` when the key is absent; NaN for any other value."""
    if key not in rec:
        return default
    v = rec[key]
    if isinstance(v, int | float):
        return v
    if isinstance(v, str) and v.strip().lower() in NON_FINITE_TEXT:
        return float(v)
    return math.nan


def usable_schedule(rec: Any) -> bool:
    if not isinstance(rec, dict) or not isinstance(rec.get("ev"), str):
        return False
    if not all(k in rec for k in SCHEDULE_NEEDS.get(rec["ev"], ())):
        return False
    for k, v in rec.items():
        if k == "groups" and rec["ev"] == "step":
            ok = isinstance(v, list) and all(_integer(g) for g in v)
        elif k == "phases" and rec["ev"] == "step":
            ok = isinstance(v, list) and all(_phase(p) for p in v)
        else:
            ok = isinstance(v, str) if k in SCHEDULE_TEXT else _number(v)
        if not ok:
            return False
    return all(_integer(rec[k]) for k in ("g", "step", "version", "vmin", "vmax", "next_g") if k in rec)


def skipped_warning(num_skipped: int, where: str) -> str:
    return f"tandem: warning: skipped {num_skipped} line(s) of {where} that are not valid records"


def _phase(v: Any) -> bool:
    """One `[phase, from, to]` of a step's `phases` (runtime/step_phases.py)."""
    return isinstance(v, list) and len(v) == 3 and isinstance(v[0], str) and _number(v[1]) and _number(v[2])


def _metric_value(v: Any) -> bool:
    """A number (a bool counts), or NaN / inf written as null or as text."""
    return v is None or isinstance(v, int | float) or (isinstance(v, str) and v.strip().lower() in NON_FINITE_TEXT)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
