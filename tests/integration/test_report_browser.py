"""The report in a real browser: headless Chromium (.ci/setup --tests installs the Debian package)
opens the page built from the recorded run with no network, runs its scripts without an
error, draws every panel (traces with drawn paths in each plot's SVG; the KL panel, with the
penalty off, none and says so) and each step's phases on a timeline lane of their own, no
panel title lies under plotly's toolbar, and its screenshot is not blank. A page whose script fails
is seen as failed (the check is not vacuous)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from PIL import Image

from runtime.views.report.browser import dump_dom, find_chromium, screenshot
from runtime.views.report.build import build_report
from runtime.views.report.panels import PANELS

RECORDED = Path(__file__).resolve().parents[1] / "data" / "tiny_run"


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if find_chromium() is None:
        pytest.fail("no chromium on PATH: run .ci/setup --tests (it installs the Debian package `chromium`)")
    return build_report(RECORDED, tmp_path_factory.mktemp("report") / "report.html")


def panel_svgs(dom: str) -> dict[str, str]:
    """Panel id → its part of the DOM (the SVG plotly drew into it)."""
    parts = re.split(r'<div class="panel[^"]*" id="(p-[\w-]+)">', dom)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def drawn_panels(dom: str) -> dict[str, int]:
    """Panel id → number of traces in its SVG that draw a path."""
    out = {}
    for pid, body in panel_svgs(dom).items():
        traces = re.findall(r'<g class="trace[ "].*?(?=<g class="trace[ "]|$)', body, re.S)
        out[pid] = sum(1 for t in traces if re.search(r'<path[^>]* d="M[^"]', t))
    return out


def test_the_page_draws_every_panel_without_a_script_error(page: Path) -> None:
    dom = dump_dom(page)
    status = re.search(r'<body[^>]*data-status="([^"]*)"', dom)
    assert status is not None and status.group(1) == "ok", status.group(1) if status else dom[:2000]
    drawn = drawn_panels(dom)
    assert set(drawn) == {"p-timeline-0", *(f"p-{p}" for p in PANELS)}
    assert drawn.pop("p-kl") == 0, "the recorded run has no KL penalty: its panel plots nothing"
    assert all(n > 0 for n in drawn.values()), drawn
    assert drawn["p-timeline-0"] >= 5, "generation, validation, trainer step, weight sync, weight load"


def test_the_timeline_draws_the_steps_phases_and_their_glue_on_a_lane_of_their_own(page: Path) -> None:
    dom = dump_dom(page)
    timeline = panel_svgs(dom)["p-timeline-0"]
    assert 'data-unformatted="step phases"' in timeline, "the lane's label is on the drawn y axis"
    legend = set(re.findall(r'class="legendtext"[^>]*>([^<]*)<', timeline))
    assert {"step: train", "step: push weights", "step: glue (no phase)"} <= legend, legend
    assert drawn_panels(dom)["p-timeline-0"] >= 6 + 3, "the schedule's six kinds, then train, push and glue"


def test_a_failing_script_is_reported_by_the_page(page: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.html"
    broken.write_text(page.read_text().replace("var FIGURES = {", "noSuchFunction(); var FIGURES = {", 1))
    status = re.search(r'data-status="([^"]*)"', dump_dom(broken))
    assert status is not None and status.group(1).startswith("error:") and "noSuchFunction" in status.group(1)


def test_the_screenshot_shows_the_plots(page: Path, tmp_path: Path) -> None:
    png = screenshot(page, tmp_path / "report.png", width=1400, height=2600)
    image = Image.open(png).convert("RGB")
    assert image.size == (1400, 2600)
    top, bottom = image.crop((0, 0, 1400, 900)), image.crop((0, 1700, 1400, 2600))
    for region in (top, bottom):  # the timeline at the top, metric panels further down
        colours = region.getcolors(maxcolors=1 << 20) or []
        assert len(colours) > 200, "a blank or nearly blank region"


OVERLAPS = """
var hidden = [];
document.querySelectorAll(".panel").forEach(function (panel) {
  var title = panel.querySelector(".gtitle"), bar = panel.querySelector(".modebar");
  if (!title || !bar) return;
  var t = title.getBoundingClientRect(), b = bar.getBoundingClientRect();
  if (t.right > b.left && t.left < b.right && t.bottom > b.top && t.top < b.bottom) hidden.push(panel.id);
});
document.body.setAttribute("data-under-toolbar", hidden.join(",") || "none");
"""


@pytest.mark.parametrize("width", [800, 1400])
def test_no_panel_title_is_under_the_plot_toolbar(page: Path, tmp_path: Path, width: int) -> None:
    """The staleness histogram's title ran under plotly's toolbar (shown on hover, top right):
    the page measures every title's box against its toolbar's once the plots are drawn."""
    checked = tmp_path / "checked.html"
    ok = 'document.body.setAttribute("data-status", "ok");'
    assert ok in page.read_text()
    checked.write_text(page.read_text().replace(ok, ok + OVERLAPS, 1))
    dom = dump_dom(checked, width=width, height=2600)
    under = re.search(r'data-under-toolbar="([^"]*)"', dom)
    assert under is not None, "the check did not run"
    assert under.group(1) == "none", under.group(1)


def test_with_the_kl_penalty_off_the_kl_panel_plots_nothing_and_says_why(page: Path) -> None:
    """It plotted importance_weight_max under the title "KL to the reference: off", the
    curve's name never shown (a panel with one trace has no legend)."""
    dom = dump_dom(page)
    kl = panel_svgs(dom)["p-kl"].split("<script", 1)[0]
    assert drawn_panels(dom)["p-kl"] == 0
    assert "importance" not in kl
    assert re.search(r"KL penalty is off \(algorithm\.kl\.enabled=false\)", kl), kl[:3000]
