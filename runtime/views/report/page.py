"""The report's HTML: one file with plotly.js inlined (it opens with no network), a summary
of each run, the timeline(s) and the metric panels.

What a caller may rely on: each figure is drawn into `<div class="panel" id="p-NAME">`;
once every figure is drawn the page sets `<body data-status="ok">` (or `"error: ..."` when a
plot or any other script failed), which a headless browser can read back."""

from __future__ import annotations

import html
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.5em; }
table.summary { border-collapse: collapse; font-size: 0.9em; }
table.summary td, table.summary th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 12px; }
.panel { border: 1px solid #eee; min-height: 200px; }
"""
ERRORS = """
window.__reportErrors = [];
window.addEventListener("error", function (e) {
  window.__reportErrors.push(String(e.message));
  document.body && document.body.setAttribute("data-status", "error: " + e.message);
});
"""
DRAW = """
(function () {
  var done = Object.keys(FIGURES).map(function (id) {
    var f = FIGURES[id];
    return Plotly.newPlot("p-" + id, f.data, f.layout, {responsive: true, displaylogo: false});
  });
  Promise.all(done).then(function () {
    if (!window.__reportErrors.length) document.body.setAttribute("data-status", "ok");
  }).catch(function (e) { document.body.setAttribute("data-status", "error: " + e); });
})();
"""


def render(
    title: str, summary: list[dict[str, Any]], timelines: dict[str, go.Figure], panels: dict[str, go.Figure]
) -> str:
    """The page: `summary` one row per run (column → value), then the timelines, then the panels."""
    figures = {**{f"timeline-{k}": f for k, f in timelines.items()}, **panels}
    data = ",".join(f'"{k}":{pio.to_json(f, validate=False)}' for k, f in figures.items())
    data = data.replace("</", "<\\/")  # never end the script element early
    divs_t = "".join(f'<div class="panel" id="p-timeline-{k}"></div>' for k in timelines)
    divs_p = "".join(f'<div class="panel" id="p-{k}"></div>' for k in panels)
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style><script>{ERRORS}</script><script>{get_plotlyjs()}</script></head>"
        f'<body data-status="loading"><h1>{html.escape(title)}</h1>{_table(summary)}'
        f'<h2>Timeline</h2>{divs_t}<h2>Metrics</h2><div class="grid">{divs_p}</div>'
        f"<script>var FIGURES = {{{data}}};{DRAW}</script></body></html>"
    )


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in cols) + "</tr>" for r in rows)
    return f'<table class="summary"><tr>{head}</tr>{body}</table>'
