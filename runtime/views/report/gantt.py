"""The timeline figure: every rollout's generation, the trainer's steps and weight syncs,
the rollouts' weight loads and validation rounds on one time axis, coloured by policy
version (one colour scale for every bar), so overlap and stalls show at a glance; each
step's phases and its glue (time no phase covers, in red) on a lane of their own."""

from __future__ import annotations

import plotly.graph_objects as go

from runtime.views.report.timeline import Timeline

KINDS = {  # kind -> (legend name, pattern shape, fixed colour or "" for the version colour)
    "generation": ("generation (training group)", "", ""),
    "validation_generation": ("generation (validation group)", "/", ""),
    "in_flight": ("in flight (not back yet)", "", "#bbbbbb"),
    "train": ("trainer step", "", ""),
    "sync": ("trainer weight sync", "x", "#444444"),
    "weights": ("rollout weight load", "", ""),
    "validation": ("validation round", ".", ""),
    "teacher": ("teacher scoring (distillation)", "", "#bcbd22"),
    # The lane "step phases": fixed colours, so a phase reads the same in every step.
    "phase_wake": ("step: wake (send → first sample starts)", "", "#17becf"),
    "phase_generate": ("step: generate", "", "#98df8a"),
    "phase_reward": ("step: reward (after the last sample)", "", "#ffbb78"),
    "phase_release": ("step: release (vLLM sleeps, trainer gives way)", "", "#c5b0d5"),
    "phase_train": ("step: train", "", "#1f77b4"),
    "phase_push": ("step: push weights", "x", "#444444"),
    "glue": ("step: glue (no phase)", "", "#d62728"),
}


def timeline_figure(tl: Timeline, title: str) -> go.Figure:
    fig = go.Figure()
    versions = [s.version for s in tl.spans if s.version >= 0] or [0]
    for kind, (name, pattern, colour) in KINDS.items():
        spans = [s for s in tl.spans if s.kind == kind]
        if not spans:
            continue
        marker: dict[str, object] = dict(line=dict(width=0.5, color="white"))
        if colour:
            marker["color"] = colour
        else:
            marker.update(color=[s.version for s in spans], coloraxis="coloraxis")
        if pattern:
            marker["pattern"] = dict(shape=pattern, fgcolor="black", fgopacity=0.35)
        fig.add_trace(
            go.Bar(
                orientation="h",
                y=[s.row for s in spans],
                x=[max(s.end - s.start, 1e-3) for s in spans],
                base=[s.start for s in spans],
                name=name,
                marker=marker,
                hovertext=[s.text for s in spans],
                hoverinfo="text",
                width=0.8,
            )
        )
    rows = list(reversed(tl.rows))  # plotly draws categories bottom-up
    fig.update_layout(
        title=title,
        barmode="overlay",
        template="plotly_white",
        height=max(260, 22 * len(rows) + 140),
        margin=dict(l=140, r=20, t=50, b=45),
        legend=dict(orientation="h", y=-0.12),
        coloraxis=dict(
            colorscale="Viridis",
            cmin=min(versions),
            cmax=max(max(versions), min(versions) + 1),
            colorbar=dict(title="policy<br>version", thickness=12),
        ),
        xaxis=dict(title="seconds since the controller started", range=[0, max(tl.end, 1e-3)]),
        yaxis=dict(categoryorder="array", categoryarray=rows, type="category"),
    )
    if not tl.spans:
        fig.update_layout(title=f"{title} (no schedule.jsonl: metrics.schedule was off or the run predates it)")
        fig.add_trace(go.Scatter(x=[0], y=[0], mode="markers", marker=dict(opacity=0), showlegend=False))
    return fig
