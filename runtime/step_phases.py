"""A training step's phases, from the times the controller saw: when the rollouts woke,
generated and the batch was scored, when vLLM slept, the trainer trained and pushed the new
weights, and the glue: the time in the step that no phase covers.

The controller computes them (roles/controller/step_runner.py) for metrics.jsonl and the
schedule's `step` record; `tandem report` draws them from the schedule (runtime/views/report).

What a caller may rely on:
* A step's window runs from the previous step's end (its trainer reply; the run's start
  for the first step after a start or resume) to its own trainer reply, so the windows of
  consecutive steps tile the run.
* `phase_spans(times)`: `(phase, from, to)` in seconds from the window's start, each phase
  of `PHASES` clipped to the window (a phase that began before it, as the samples of an
  async run generated while the previous step trained, starts at 0); a phase the step did
  not have (or that lies wholly before the window) is left out. `release` may be there
  twice: vLLM going to sleep before training and the trainer giving its memory back after
  the push.
* `phase_metrics(times)`: the `phase_*` and `step_glue_s` fields of metrics.jsonl
  (docs/metrics.md): every one ≥ 0, `phase_first_token_s` ≤ `phase_last_token_s`, and
  `step_glue_s` = the window minus the union of the spans.
* `gaps(spans, length)`: the stretches of [0, length] that no span covers, in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

PHASES = ("wake", "generate", "reward", "release", "train", "push")

Span = tuple[str, float, float]


@dataclass(frozen=True)
class StepTimes:
    """Unix times (seconds) of one step as the controller saw them; 0.0: not seen."""

    start: float  # the window opened: the previous step's trainer reply, or the run's start
    end: float  # the trainer's reply to this step's batch
    dispatched: float = 0.0  # the batch's first group went to a rollout (its latest attempt)
    gen_started: float = 0.0  # the batch's earliest sample began generating
    first_sample: float = 0.0  # the batch's first sample arrived
    last_sample: float = 0.0  # the batch's last sample arrived
    ready: float = 0.0  # the batch's last group was scored (queued for training)
    rest: tuple[float, float] | None = None  # the `SleepBeforeStep` round trip (vLLM sleeps), synchronous runs
    train_sent: float = 0.0  # the batch went to the trainer
    trainer: Mapping[str, float] = field(default_factory=dict)  # busy_s, train_s, weight_sync_s, release_s


def phase_spans(t: StepTimes) -> list[Span]:
    """The step's phases in the order they begin (see the module docstring)."""
    raw: list[Span] = [
        ("wake", t.dispatched, t.gen_started),
        ("generate", t.gen_started, t.last_sample),
        ("reward", t.last_sample, t.ready),
        *([("release", *t.rest)] if t.rest is not None else []),
        *_trainer(t),
    ]
    length = t.end - t.start
    spans = [(name, max(a - t.start, 0.0), min(b - t.start, length)) for name, a, b in raw if a > 0.0 and b > 0.0]
    return sorted((s for s in spans if s[2] > s[1]), key=lambda s: s[1])


def _trainer(t: StepTimes) -> list[Span]:
    """Train, push and give-way, laid back from the reply: rank 0 replies once its
    `busy_s` is over, which ends with the push and then the give-way (`release_s`)."""
    m = t.trainer
    began = max(t.train_sent, t.end - m["busy_s"]) if "busy_s" in m else t.train_sent
    push_end = t.end - m.get("release_s", 0.0)
    return [
        ("train", began, began + m.get("train_s", 0.0)),
        ("push", push_end - m.get("weight_sync_s", 0.0), push_end),
        ("release", push_end, t.end),
    ]


def gaps(spans: Iterable[Span], length: float) -> list[tuple[float, float]]:
    """The stretches of [0, `length`] that no span covers, in order."""
    out: list[tuple[float, float]] = []
    covered = 0.0
    for _, a, b in sorted(spans, key=lambda s: s[1]):
        if a > covered:
            out.append((covered, min(a, length)))
        covered = max(covered, b)
    if covered < length:
        out.append((covered, length))
    return [(a, b) for a, b in out if b > a]


def phase_metrics(t: StepTimes) -> dict[str, float]:
    """The step's `phase_*` durations, its first and last sample's arrival (offsets from
    the window's start) and its glue, in seconds."""
    spans = phase_spans(t)
    length = max(t.end - t.start, 0.0)

    def total(name: str) -> float:
        return sum(b - a for n, a, b in spans if n == name)

    def offset(when: float) -> float:
        return min(max(when - t.start, 0.0), length) if when > 0.0 else 0.0

    return {
        **{f"phase_{name}_s": total(name) for name in PHASES},
        "phase_first_token_s": offset(t.first_sample),
        "phase_last_token_s": offset(t.last_sample),
        "step_glue_s": sum(b - a for a, b in gaps(spans, length)),
    }
