"""Every pointer in the tree leads somewhere. A comment, docstring or page that sends the
reader to a section (a page name followed by a quoted heading, as in the README's own
pointers to docs/running.md, or a `#anchor`) names a file that exists and a heading that
file has; a `docs/` page named anywhere exists; a Markdown link to a page resolves. Sections
move between pages, and a pointer left behind sends a reader to nothing."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import ROOT

SUFFIXES = {".py", ".toml", ".yaml", ".yml", ".md", ".sh"}
SKIP_DIRS = {".git", ".venv", "runs", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}

# A page: the README (with or without `.md`) or any `name.md`, optionally under `docs/`; not
# part of a longer path or of a string literal (`"docs/x.md"` in code is a file name, not prose).
PAGE = r"(?<![\w/\"'.-])(?P<page>README(?:\.md)?\b|(?:docs/)?[A-Za-z][\w-]*\.md\b)"
# What may stand between the page and its section: `'s`, a comma, colon or opening bracket,
# the `)` closing a Markdown link, and comment markers where a pointer wraps across lines.
GAP = r"(?:'s)?[\s#)]*(?:[,(:][\s#]*)?"
SECTION = r"[\"“](?P<section>[A-Za-z`][^\"”\n]{1,80})[\"”]"
POINTER = re.compile(PAGE + r"(?:#(?P<anchor>[\w-]+)|" + GAP + SECTION + ")")
# The other order: `"Some heading" (docs/page.md`, `"Some heading" example (docs/page.md`.
POINTER_AFTER = re.compile(SECTION + r"(?:\s+(?:section|example|part))?\s+\(" + PAGE)
DOCS_PAGE = re.compile(r"(?<![\w/.-])docs/[\w-]+\.md\b")
LINK = re.compile(r"\]\((?P<target>[^)\s:#]+\.md)(?:#(?P<anchor>[\w-]+))?\)")
HERE = Path(__file__).resolve()


def _files() -> Iterator[Path]:
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for name in sorted(names):
            path = Path(folder, name)
            if (path.suffix in SUFFIXES or path.parent.name == ".ci") and path.resolve() != HERE:
                yield path


def _normal(text: str) -> str:
    return " ".join(text.replace("`", "").replace("*", "").split()).casefold()


def _headings(page: Path) -> list[str]:
    """The page's headings, outside fenced code blocks, without `#`s, backticks or emphasis."""
    found, fenced = [], False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.append(_normal(line.lstrip("#")))
    return found


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def _has_section(page: Path, section: str) -> bool:
    """A heading that is the quoted words or begins with them (up to a word boundary):
    `"Long-tail"` names "Long-tail response lengths (3 repeats) ...", `"Long"` does not."""
    want = _normal(section)
    return any(h == want or (h.startswith(want) and not re.match(r"[\w-]", h[len(want)])) for h in _headings(page))


def _resolve(name: str, source: Path) -> Path | None:
    if name == "README":
        name = "README.md"
    for candidate in (source.parent / name, ROOT / name, ROOT / "docs" / name):
        if candidate.is_file():
            return candidate
    return None


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def broken_pointers(path: Path, text: str) -> list[str]:
    """`file:line: why` for each pointer in `text` (the contents of `path`) that leads nowhere."""
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    bad = []
    for match in [*POINTER.finditer(text), *POINTER_AFTER.finditer(text)]:
        page = _resolve(match["page"], path)
        at = f"{where}:{_line(text, match.start())}"
        if page is None:
            bad.append(f"{at}: {match['page']} does not exist")
        elif match["section"] is not None and not _has_section(page, match["section"]):
            bad.append(f'{at}: {page.relative_to(ROOT)} has no section "{match["section"]}"')
        elif match.groupdict().get("anchor") and match["anchor"] not in map(_slug, _headings(page)):
            bad.append(f"{at}: {page.relative_to(ROOT)} has no heading for #{match['anchor']}")
    for match in DOCS_PAGE.finditer(text):
        if not (ROOT / match[0]).is_file():
            bad.append(f"{where}:{_line(text, match.start())}: {match[0]} does not exist")
    for match in LINK.finditer(text):
        target = (path.parent / match["target"]).resolve()
        if not target.is_file():
            bad.append(f"{where}:{_line(text, match.start())}: the link to {match['target']} leads nowhere")
        elif match["anchor"] and match["anchor"] not in map(_slug, _headings(target)):
            bad.append(f"{where}:{_line(text, match.start())}: {match['target']} has no heading for #{match['anchor']}")
    return bad


def test_every_pointer_to_a_page_or_section_leads_to_one() -> None:
    bad = [line for path in _files() for line in broken_pointers(path, path.read_text(errors="replace"))]
    assert not bad, "pointers to pages or sections that do not exist:\n" + "\n".join(bad)


def test_the_scan_finds_pointers_in_the_forms_the_tree_writes_them() -> None:
    """The scan itself: each form a pointer takes here is read, a wrong one is reported with
    its line, and file names in code are not taken for pointers."""
    q = '"'
    source = ROOT / "example.md"
    good = [
        f"see docs/running.md, {q}Checkpoints, resume, export{q}.",
        f"# see BENCHMARKS.md\n# ({q}Transport{q}).",
        f"([docs/running.md](docs/running.md), {q}Reproducible runs{q})",
        f"BENCHMARKS.md {q}Long-tail{q} and docs/fsdp.md#one-rank",
        f"The {q}Environments and tools{q} example (docs/rollout.md)",
        f"ROOT / {q}README.md{q}, {q}LICENSE{q}; compile(code, {q}docs/ecosystem.md{q}, {q}exec{q})",
    ]
    for text in good:
        assert broken_pointers(source, text) == [], text
    wrong = {
        f"line one\nsee README {q}Reading metrics{q}": 'example.md:2: README.md has no section "Reading metrics"',
        f"the README's {q}LoRA{q} section": 'example.md:1: README.md has no section "LoRA"',
        f"BENCHMARKS.md {q}Long{q}": 'example.md:1: BENCHMARKS.md has no section "Long"',
        "docs/nowhere.md": "example.md:1: docs/nowhere.md does not exist",
        "docs/fsdp.md#no-such-heading": "example.md:1: docs/fsdp.md has no heading for #no-such-heading",
        f"The {q}Nothing here{q} (docs/rollout.md)": 'example.md:1: docs/rollout.md has no section "Nothing here"',
    }
    for text, message in wrong.items():
        assert message in broken_pointers(source, text), (text, broken_pointers(source, text))
