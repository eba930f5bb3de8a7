"""The schedule log (roles/controller/schedule.py writes it) as spans on a timeline.

What a caller may rely on:
* `trained_at(schedule)`: every trained group's id → the step that trained it.
* `build_timeline(schedule)`: spans in seconds since the run's first record. Each rollout's
  generation spans (a group from its earliest sample's start to its last sample's arrival)
  are spread over lanes `"rollout-0 · k"` so spans of one lane never overlap (validation
  groups: over at most 4 lanes `"rollout-0 val · k"`, which may overlap); the trainer's
  step is split into its compute (`train`) and its weight sync (`sync`, the step's last
  `sync_s` seconds); each rollout's weight loads are on `"<rollout> weights"`; validation
  rounds on `"validation"`; a distillation teacher's scoring of each group (its request, which
  may overlap others) on `"<teacher> scoring"`. Groups dispatched but never sampled (a crashed run, or one still
  going) end at the last record's time, as `in_flight` (validation groups a round gave up
  on are left out). A span's `version` is the policy
  version it ran with (a group's oldest token; the version a step trained from).
* Each step's phases (runtime/step_phases.py: `wake`, `generate`, `reward`, `release`,
  `train`, `push`, kind `phase_<name>`) are on the lane `"step phases"`, and every stretch
  of its window that no phase covers as a `glue` span there, so a gap shows; runs whose
  schedule predates the phases have no such lane.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from runtime.step_phases import gaps

VAL_LANES = 4


@dataclass
class Span:
    row: str
    start: float
    end: float
    version: int
    kind: str  # generation | validation_generation | in_flight | train | sync | weights | validation | phase_* | glue
    text: str


@dataclass
class Timeline:
    t0: float
    end: float
    spans: list[Span] = field(default_factory=list)
    rows: list[str] = field(default_factory=list)  # top to bottom


def trained_at(schedule: list[dict[str, Any]]) -> dict[int, int]:
    return {int(g): int(r["step"]) for r in schedule if r.get("ev") == "step" for g in r.get("groups", [])}


def group_staleness(schedule: list[dict[str, Any]]) -> list[int]:
    """Per trained group: the version the trainer was at (step − 1) minus its oldest token's."""
    vmin = {r["g"]: int(r["vmin"]) for r in schedule if r.get("ev") == "sampled"}
    return [step - 1 - vmin[g] for g, step in trained_at(schedule).items() if g in vmin]


def build_timeline(schedule: list[dict[str, Any]]) -> Timeline:
    times = [float(r["t"]) for r in schedule if "t" in r]
    if not times:
        return Timeline(t0=0.0, end=0.0)
    t0 = min(min(times), *(float(r[k]) for r in schedule for k in ("t0", "w0") if k in r))
    tl = Timeline(t0=t0, end=max(times) - t0)
    fate = _fates(schedule)
    gen = _generation(schedule, t0, tl.end, fate)
    tl.rows += _lanes(gen, tl.spans)
    tl.rows += _trainer(schedule, t0, tl.spans)
    tl.rows += _phases(schedule, t0, tl.spans)
    tl.rows += _weights(schedule, t0, tl.spans)
    tl.rows += _validation(schedule, t0, tl.spans)
    tl.rows += _teacher(schedule, t0, tl.spans)
    return tl


def _fates(schedule: list[dict[str, Any]]) -> dict[int, str]:
    fate = {g: f"trained at step {s}" for g, s in trained_at(schedule).items()}
    for r in schedule:
        if r.get("ev") == "drop":
            fate[int(r["g"])] = f"dropped: {r['why']} {r.get('detail', '')}".strip()
    return fate


def _generation(schedule: list[dict[str, Any]], t0: float, end: float, fate: dict[int, str]) -> list[Span]:
    spans: list[Span] = []
    sent: dict[int, dict[str, Any]] = {}
    for r in schedule:
        ev = r.get("ev")
        if ev == "dispatch":
            sent[int(r["g"])] = r
        elif ev in ("admit", "requeue"):
            sent.pop(int(r["g"]), None)
        elif ev == "run":  # a (re)start: what was in flight before died with the old controller
            sent = {}
        elif ev == "val":  # the round is over: its groups not back were cancelled
            sent = {g: d for g, d in sent.items() if g >= 0}
        elif ev == "sampled":
            g = int(r["g"])
            sent.pop(g, None)
            kind = "validation_generation" if g < 0 else "generation"
            what = "validation group" if g < 0 else f"group {g}"
            text = (
                f"{what} · versions {r['vmin']}–{r['vmax']} · {r['tok']} tokens · "
                f"{float(r['t']) - float(r['t0']):.2f}s · {fate.get(g, 'not trained yet')}"
            )
            spans.append(Span(str(r["to"]), float(r["t0"]) - t0, float(r["t"]) - t0, int(r["vmin"]), kind, text))
    for g, r in sent.items():
        spans.append(Span(str(r["to"]), float(r["t"]) - t0, end, -1, "in_flight", f"group {g} in flight"))
    return spans


def _lanes(gen: list[Span], out: list[Span]) -> list[str]:
    """Spread each rollout's spans over as few non-overlapping lanes as it needs; validation
    groups (often dozens at once) get lanes of their own, at most `VAL_LANES`, which may overlap."""
    by_row: dict[tuple[str, bool], list[Span]] = defaultdict(list)
    for s in gen:
        by_row[(s.row, s.kind == "validation_generation")].append(s)
    rows: list[str] = []
    for rollout, val in sorted(by_row):
        prefix = f"{rollout} val" if val else rollout
        ends: list[float] = []
        for s in sorted(by_row[(rollout, val)], key=lambda s: s.start):
            lane = next((i for i, e in enumerate(ends) if e <= s.start), len(ends))
            if lane == len(ends):
                ends.append(s.end)
            ends[lane] = s.end
            s.row = f"{prefix} · {lane % VAL_LANES if val else lane}"
            out.append(s)
        rows += [f"{prefix} · {i}" for i in range(min(len(ends), VAL_LANES) if val else len(ends))]
    return rows


def _trainer(schedule: list[dict[str, Any]], t0: float, out: list[Span]) -> list[str]:
    steps = [r for r in schedule if r.get("ev") == "step"]
    for r in steps:
        start, end = float(r["t0"]) - t0, float(r["t"]) - t0
        sync = min(float(r.get("sync_s", 0.0)), end - start)
        n, v = int(r["step"]), int(r["version"])
        out.append(
            Span(
                "trainer",
                start,
                end - sync,
                v - 1,
                "train",
                f"step {n}: trained version {v - 1} → {v} on {len(r['groups'])} groups "
                f"({float(r.get('train_s', end - start - sync)):.2f}s compute)",
            )
        )
        if sync > 0:
            phases = " ".join(f"{k[:-2]} {float(r[k]):.3f}s" for k in ("gather_s", "transfer_s", "load_s") if k in r)
            out.append(Span("trainer", end - sync, end, v, "sync", f"step {n}: weight sync {sync:.3f}s {phases}"))
    return ["trainer"] if steps else []


def _phases(schedule: list[dict[str, Any]], t0: float, out: list[Span]) -> list[str]:
    steps = [r for r in schedule if r.get("ev") == "step" and {"phases", "w0", "w1"} <= r.keys()]
    for r in steps:
        w0, n, v = float(r["w0"]) - t0, int(r["step"]), int(r["version"]) - 1
        spans = [(str(p), float(a), float(b)) for p, a, b in r["phases"]]
        for p, a, b in spans:
            text = f"step {n}: {p} {b - a:.3f}s (from +{a:.3f}s in the step)"
            out.append(Span("step phases", w0 + a, w0 + b, v, f"phase_{p}", text))
        glue = float(r.get("glue_s", 0.0))
        for a, b in gaps(spans, float(r["w1"]) - float(r["w0"])):
            text = f"step {n}: glue {b - a:.3f}s (from +{a:.3f}s; the step's glue {glue:.3f}s)"
            out.append(Span("step phases", w0 + a, w0 + b, v, "glue", text))
    return ["step phases"] if steps else []


def _weights(schedule: list[dict[str, Any]], t0: float, out: list[Span]) -> list[str]:
    rows: set[str] = set()
    for r in (r for r in schedule if r.get("ev") == "sync"):
        row = f"{r['to']} weights"
        rows.add(row)
        s, e = float(r["t0"]) - t0, float(r["t"]) - t0
        text = f"{r['to']} loads version {r['version']}: {e - s:.3f}s (receive {r['receive_s']}s, load {r['load_s']}s)"
        out.append(Span(row, s, e, int(r["version"]), "weights", text))
    return sorted(rows)


def _validation(schedule: list[dict[str, Any]], t0: float, out: list[Span]) -> list[str]:
    rounds = [r for r in schedule if r.get("ev") == "val"]
    for r in rounds:
        s, e = float(r["t0"]) - t0, float(r["t"]) - t0
        text = f"validation after step {r['step']} ({r['groups']} prompts) {e - s:.2f}s"
        out.append(Span("validation", s, e, int(r["version"]), "validation", text))
    return ["validation"] if rounds else []


def _teacher(schedule: list[dict[str, Any]], t0: float, out: list[Span]) -> list[str]:
    """A distillation teacher's answer to each group, from its request to its reply."""
    rows: set[str] = set()
    for r in (r for r in schedule if r.get("ev") == "teacher"):
        row = f"{r['to']} scoring"
        rows.add(row)
        e = float(r["t"]) - t0
        text = f"{r['to']} scores group {r['g']}: {r['tok']} tokens in {r['s']}s, {r['fail']} failed"
        out.append(Span(row, e - float(r["s"]), e, -1, "teacher", text))
    return sorted(rows)
