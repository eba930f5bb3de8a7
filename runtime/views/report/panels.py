"""The report's metric panels: one plotly figure each, every run of the report overlaid
(the first solid, a `--compare` run dashed).

What a caller may rely on: `metric_panels(runs)` returns every panel of `PANELS`, in that
order, each with at least one trace, except the KL panel when no run has a KL penalty: it
plots nothing (no other metric in its place) and says across its plot that the penalty is
off. Titles are short enough to stay clear of plotly's toolbar (top right, on hover)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import plotly.graph_objects as go

from runtime.views.report.load import RunData
from runtime.views.report.timeline import group_staleness

PANELS = (
    "reward",
    "response_len",
    "staleness_hist",
    "staleness_max",
    "throughput",
    "idle",
    "weight_sync",
    "logprob_gap",
    "clip_fraction",
    "kl",
    "distill",
)
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")
DASH = ("solid", "dash")


def metric_panels(runs: list[RunData]) -> dict[str, go.Figure]:
    makers: dict[str, Callable[[list[RunData]], go.Figure]] = {
        "reward": _reward,
        "response_len": _response_len,
        "staleness_hist": _staleness_hist,
        "staleness_max": _staleness_max,
        "throughput": _throughput,
        "idle": _idle,
        "weight_sync": _weight_sync,
        "logprob_gap": _logprob_gap,
        "clip_fraction": _clip,
        "kl": _kl,
        "distill": _distill,
    }
    return {name: makers[name](runs) for name in PANELS}


def _figure(title: str, y: str, x: str = "step", **layout: Any) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(
        title=title,
        xaxis_title=x,
        yaxis_title=y,
        height=320,
        margin=dict(l=60, r=20, t=50, b=45),
        legend=dict(orientation="h", y=-0.25),
        template="plotly_white",
        **layout,
    )
    return fig


def _lines(fig: go.Figure, runs: list[RunData], keys: list[tuple[str, str]], **trace: Any) -> int:
    """A line per (key, label) per run that has it; returns how many were drawn."""
    drawn = 0
    for i, run in enumerate(runs):
        for j, (key, label) in enumerate(keys):
            if not run.has(key):
                continue
            x, y = run.series(key)
            name = label if len(runs) == 1 else f"{label} ({run.name})"
            line = dict(color=COLOURS[j % len(COLOURS)], dash=DASH[i % len(DASH)])
            fig.add_trace(go.Scatter(x=x, y=y, name=name, mode="lines", line=line, **trace))
            drawn += 1
    return drawn


def _reward(runs: list[RunData]) -> go.Figure:
    fig = _figure("Reward (training batch) and validation", "reward")
    _lines(fig, runs, [("reward_mean", "reward")])
    for i, run in enumerate(runs):
        val = [r for r in run.validation if isinstance(r.get("val/reward_mean"), int | float)]
        if val:
            suffix = "" if len(runs) == 1 else f" ({run.name})"
            fig.add_trace(
                go.Scatter(
                    x=[r["step"] for r in val],
                    y=[r["val/reward_mean"] for r in val],
                    name=f"validation{suffix}",
                    mode="lines+markers",
                    line=dict(color=COLOURS[2], dash=DASH[i % 2]),
                )
            )
    return fig


def _response_len(runs: list[RunData]) -> go.Figure:
    fig = _figure("Response length", "tokens")
    _lines(fig, runs, [("response_len_mean", "mean response length")])
    for i, run in enumerate(runs):
        val = [r for r in run.validation if isinstance(r.get("val/response_len_mean"), int | float)]
        if val:
            fig.add_trace(
                go.Scatter(
                    x=[r["step"] for r in val],
                    y=[r["val/response_len_mean"] for r in val],
                    mode="lines+markers",
                    name="validation" if len(runs) == 1 else f"validation ({run.name})",
                    line=dict(color=COLOURS[2], dash=DASH[i % 2]),
                )
            )
    return fig


def _staleness_hist(runs: list[RunData]) -> go.Figure:
    # A short title: a longer one ran under plotly's toolbar (top right, shown on hover).
    fig = _figure(
        "Staleness of trained groups", "groups", x="staleness (trainer version − oldest token's)", barmode="group"
    )
    for i, run in enumerate(runs):
        values = group_staleness(run.schedule)
        source = "schedule"
        if not values:  # no schedule: each step's mean, rounded
            values, source = [round(v) for v in run.series("staleness_mean")[1] if math.isfinite(v)], "step means"
        fig.add_trace(go.Histogram(x=values, name=f"{run.name} ({source})", marker_color=COLOURS[i % len(COLOURS)]))
    fig.update_xaxes(dtick=1)
    return fig


def _staleness_max(runs: list[RunData]) -> go.Figure:
    fig = _figure("Staleness per step", "versions")
    _lines(fig, runs, [("staleness_max", "max"), ("staleness_mean", "mean")], line_shape="hv")
    return fig


def _throughput(runs: list[RunData]) -> go.Figure:
    fig = _figure("Throughput", "samples/s", yaxis2=dict(title="tokens/s", overlaying="y", side="right"))
    _lines(fig, runs, [("samples_per_s", "samples/s")])
    _lines(fig, runs, [("tokens_per_s", "tokens/s")], yaxis="y2", opacity=0.6)
    return fig


def _idle(runs: list[RunData]) -> go.Figure:
    fig = _figure("Idle ratio (1 − busy / step window)", "idle", yaxis=dict(range=[0, 1.05]))
    _lines(fig, runs, [("rollout_idle_ratio", "rollouts"), ("trainer_idle_ratio", "trainer")])
    return fig


def _weight_sync(runs: list[RunData]) -> go.Figure:
    fig = _figure("Weight sync (trainer side) and its phases", "seconds", barmode="stack")
    phases = [
        ("weight_sync_gather_s", "gather"),
        ("weight_sync_transfer_s", "transfer"),
        ("weight_sync_load_s", "load"),
    ]
    for i, run in enumerate(runs):
        for j, (key, label) in enumerate(phases):
            if run.has(key):
                x, y = run.series(key)
                name = label if len(runs) == 1 else f"{label} ({run.name})"
                fig.add_trace(
                    go.Bar(
                        x=x,
                        y=y,
                        name=name,
                        marker_color=COLOURS[(j + 3) % len(COLOURS)],
                        offsetgroup=str(i),
                        opacity=0.8,
                    )
                )
    _lines(fig, runs, [("weight_sync_s", "total")])
    return fig


def _logprob_gap(runs: list[RunData]) -> go.Figure:
    fig = _figure("Behaviour / proximal policy gap", "KL (k3)")
    _lines(
        fig,
        runs,
        [("kl_behaviour_proximal", "KL(π_behav ‖ π_prox)"), ("behaviour_proximal_abs_diff", "mean |Δ logprob|")],
    )
    return fig


def _clip(runs: list[RunData]) -> go.Figure:
    fig = _figure("PPO clip fraction", "fraction of tokens")
    _lines(fig, runs, [("clip_fraction", "clipped"), ("truncated_fraction", "importance weight truncated")])
    return fig


def _kl(runs: list[RunData]) -> go.Figure:
    fig = _figure("KL to the reference policy", "KL")
    if not _lines(fig, runs, [("kl_ref", "KL(π ‖ π_ref)"), ("kl_coef", "KL coefficient")]):
        fig.update_layout(title="KL to the reference policy: off", xaxis_visible=False, yaxis_visible=False)
        fig.add_annotation(
            text="The KL penalty is off (algorithm.kl.enabled=false): no KL to plot.",
            showarrow=False,
            xref="paper",
            yref="paper",
            x=0.5,
            y=0.5,
        )
    return fig


def _distill(runs: list[RunData]) -> go.Figure:
    """On-policy distillation: the per-token reverse KL to the teacher and how long each
    step waited on the teacher after its last sample (docs/distillation.md)."""
    fig = _figure("Distillation: reverse KL to the teacher, teacher wait", "nats / seconds")
    keys = [("distill_kl", "KL(π ‖ π_teacher) per token"), ("teacher_wait_s", "teacher wait (s)")]
    if not _lines(fig, runs, keys):
        fig.update_layout(title="Distillation: off (algorithm.distill.teacher unset)", yaxis_title="reward")
        _lines(fig, runs, [("reward_mean", "reward (shown instead)")])
    return fig
