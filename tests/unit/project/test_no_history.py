"""Code, tests and docs describe main (CONTRIBUTING.md, "Docs describe main"): no line says at,
since or until which commit something was learnt or changed. Results keep their provenance:
BENCHMARKS.md names the commit each figure was measured at, and docs/gpu-verification.md's
table the commits its GPU tests passed at, so those two are read only outside their tables."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT
from tests.unit.project.test_doc_pointers import _files

# A short or long commit hash (hex with a digit and a letter) after a word that dates it.
HISTORY = re.compile(
    r"\b(?:[Aa]t|[Ss]ince|[Uu]ntil|[Bb]efore|[Aa]fter)(?: commits?)? (?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"
    r"|\b[Uu]ntil commit\b"
)
# Outside the results pages, naming a commit at all is history.
COMMIT = re.compile(r"\b[Cc]ommits? (?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
RESULTS = {ROOT / "BENCHMARKS.md", ROOT / "docs" / "gpu-verification.md"}
HERE = Path(__file__).resolve()


def history_lines(path_name: str, text: str, *, results: bool) -> list[str]:
    """`file:line: text` for each line of `text` that dates something by a commit; in a results
    page table rows are left alone, and a header's "commit 6d23ac7" is provenance, not history."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if results and line.startswith("|"):
            continue
        if HISTORY.search(line) or (not results and COMMIT.search(line)):
            found.append(f"{path_name}:{number}: {line.strip()}")
    return found


def test_no_code_test_or_doc_dates_a_statement_by_a_commit() -> None:
    bad = [
        hit
        for path in _files()
        if path.resolve() != HERE
        for hit in history_lines(str(path.relative_to(ROOT)), path.read_text(errors="replace"), results=path in RESULTS)
    ]
    assert not bad, "history in code, tests or docs (keep the reason, drop the commit):\n" + "\n".join(bad)


def test_the_scan_reads_the_forms_history_took() -> None:
    # The forms are built from parts, so this file itself holds no line the scans flag.
    at, until = "at ", "Until " + "commit "
    hits = history_lines(
        "x.py",
        f"# {at}6d23ac7 the step read 2.99 s\n{until}6603a04 the model\nsince 22fde54 every lever\n"
        f"{at}1000000 steps, at decade, 0x1f2e3d4c\n(commit 2ffbcce: megatron hands",
        results=False,
    )
    assert [h.split(":")[1] for h in hits] == ["1", "2", "3", "5"], hits
    table = f"| 1x H200 | {at}6d23ac7 | 2026-12-04 |\n2026-12-04, commit 6d23ac7, 1x H200\n{until}6603a04 it had"
    assert [h.split(":")[1] for h in history_lines("BENCHMARKS.md", table, results=True)] == ["3"]
