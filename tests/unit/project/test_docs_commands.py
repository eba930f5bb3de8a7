"""The docs' commands run from a shell that activated nothing: a command line of a code block
in the README, CONTRIBUTING, BENCHMARKS or docs/ names the venv's program (`.venv/bin/tandem`,
`.venv/bin/python`), unless its page activates the venv first (`source .venv/bin/activate`,
as docs/walkthrough.md does). `python3` is the GPU machine's interpreter, set up as
docs/gpu-verification.md says. And the README's account of configs/tiny_cpu.yaml is the
config's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from runtime.config.load import load_config
from tests.conftest import ROOT

PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
BARE = re.compile(r"^(?:[A-Z_]+=\S* )*(tandem|python)\s")  # `tandem ...`, `PYTHONPATH=. tandem ...`, `python -c`


def command_lines(page: Path) -> list[str]:
    """The lines of the page's code blocks: indented four spaces, or fenced as sh/bash/console."""
    lines, fence = [], None
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
        elif fence in ("sh", "bash", "console", "shell", "") or (fence is None and line.startswith("    ")):
            lines.append(line.strip().removeprefix("$ "))
    return lines


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_names_the_venvs_program_or_the_page_activates_it(page: Path) -> None:
    if "source .venv/bin/activate" in "\n".join(command_lines(page)):
        return
    bare = [line for line in command_lines(page) if BARE.match(line)]
    assert not bare, f"{page.name}: write .venv/bin/{BARE.match(bare[0]).group(1)}: {bare[0]}"  # type: ignore[union-attr]


def test_the_walkthrough_activates_before_its_first_command() -> None:
    lines = [line for line in command_lines(ROOT / "docs" / "walkthrough.md") if line]
    assert lines[0] == "source .venv/bin/activate"


def test_the_readme_describes_the_tiny_config_as_it_is() -> None:
    section = (ROOT / "README.md").read_text().split("## One run, explained", 1)[1].split("\n## ", 1)[0]
    cfg = yaml.safe_load((ROOT / "configs" / "tiny_cpu.yaml").read_text())
    claims = re.findall(r"`([a-z_]+(?:\.[a-z_]+)+): ([^`]+)`", section)
    assert ("rollout.max_staleness", str(cfg["rollout"]["max_staleness"])) in claims
    for key, value in claims:
        node = cfg
        for part in key.split("."):
            node = node[part]
        assert yaml.safe_load(value) == node, (key, value, node)
    staleness = load_config(ROOT / "configs" / "tiny_cpu.yaml").rollout.max_staleness
    assert f"`rollout.max_staleness` (here {staleness})" in " ".join(section.split())
