"""The launcher's per-step progress line, fitted to the terminal's width.

What a caller may rely on: `ProgressLine(step, total, fields, eta)` renders as one line no
wider than the console: a bar, `step/total`, then as many of `fields` as fit, then the
ETA. The bar, the step count and the ETA are always there; the fields are dropped in order
of their `rank` (the highest first), so a narrow terminal loses the idle ratios and the drop
count before the reward. `step_fields(rec, wall)` are a step record's fields, in the order
they are shown; a NaN or infinite metric shows as `nan` / `inf` (runtime/views/records.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rich.console import Console, ConsoleOptions
from rich.text import Text

from runtime.views.records import metric

BAR_MIN, BAR_MAX = 10, 40
FIELDS_ROOM = 110  # columns kept for the count, every field and the ETA before the bar grows past BAR_MIN


@dataclass(frozen=True)
class Field:
    text: str
    rank: int  # the order in which fields are dropped when the line is too wide: highest first


def step_fields(rec: dict[str, Any], wall: str) -> list[Field]:
    """A step record's fields as the progress line shows them, in display order; a
    distillation run's (`distill_kl` in the record) add the reverse KL and the teacher's wait."""
    teacher = [Field(f"kl {metric(rec, 'distill_kl'):.3f}", 1)] if "distill_kl" in rec else []
    if "teacher_wait_s" in rec:
        teacher.append(Field(f"teacher wait {metric(rec, 'teacher_wait_s'):.2f}s", 7))
    return [
        Field(f"v{rec.get('policy_version', '?')}", 5),
        Field(f"reward {metric(rec, 'reward_mean'):.3f}", 1),
        *teacher,
        Field(f"len {metric(rec, 'response_len_mean'):.1f}", 2),
        Field(f"stale≤{metric(rec, 'staleness_max')}", 4),
        Field(f"drop {metric(rec, 'dropped_stale')}" + _errors(rec), 7),
        Field(f"{metric(rec, 'samples_per_s'):.1f} samples/s", 6),
        Field(f"idle gen {metric(rec, 'rollout_idle_ratio'):.0%} train {metric(rec, 'trainer_idle_ratio'):.0%}", 8),
        Field(wall, 3),
    ]


def _errors(rec: dict[str, Any]) -> str:
    """` error N (env N)`: samples dropped this step because one of their group failed, and
    how many of them an environment or agent failed; "" when none."""
    errors = rec.get("dropped_error") or 0
    if not errors:
        return ""
    parts = [
        f"{k.removeprefix('dropped_error_')} {v}"
        for k, v in sorted(rec.items())
        if k.startswith("dropped_error_") and v
    ]
    return f" error {errors}" + (f" ({', '.join(parts)})" if parts else "")


def fit(fields: list[Field], room: int) -> list[Field]:
    """The fields that fit in `room` columns (one space before each), dropped by rank."""
    kept = sorted(fields, key=lambda f: f.rank)
    while kept and sum(len(f.text) + 1 for f in kept) > room:
        kept.pop()
    return [f for f in fields if f in kept]


def plain_line(step: int, total: int, fields: list[Field], eta: str) -> str:
    """Every field, for a log or a pipe: `step 3/40 v3 reward 0.038 ... eta 1s`."""
    return " ".join([f"step {step}/{total}", *(f.text for f in fields), f"eta {eta}"])


class ProgressLine:
    """A rich renderable: the line for the width it is rendered at (a resized terminal
    gets a line for its new width at the next refresh)."""

    def __init__(self, step: int, total: int, fields: list[Field], eta: str) -> None:
        self.step, self.total, self.fields, self.eta = step, total, fields, eta

    def render(self, width: int) -> Text:
        count, eta = f" {self.step}/{self.total}", f" eta {self.eta}"
        # The bar's length depends on the width alone, so it does not jump as the numbers do.
        bar = max(0, min(BAR_MAX, max(BAR_MIN, width - FIELDS_ROOM), width - len(count) - len(eta)))
        kept = fit(self.fields, width - bar - len(count) - len(eta))
        tail = "".join(f" {f.text}" for f in kept)
        done = round(bar * min(1.0, self.step / self.total)) if self.total > 0 else bar
        return Text.assemble(
            ("━" * done, "bar.complete"), ("━" * (bar - done), "bar.back"), (count, "progress.download"), tail, eta
        )

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Text]:
        line = self.render(options.max_width)
        line.no_wrap = True
        line.overflow = "crop"
        yield line
