"""CONTRIBUTING's account of the unit tier stays near the truth: it said "833 tests" when
the tier had 1097. The documented count must be within 10% of what pytest collects."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT


def test_the_unit_tiers_test_count_is_within_ten_percent_of_the_real_one() -> None:
    lines = (ROOT / "CONTRIBUTING.md").read_text().splitlines()
    row = next(line for line in lines if line.startswith("| `tests/unit/`"))
    documented = int(re.search(r"(\d+) tests", row).group(1))  # type: ignore[union-attr]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/unit", "--collect-only", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    collected = int(re.search(r"(\d+) tests? collected", out.stdout).group(1))  # type: ignore[union-attr]
    assert abs(collected - documented) <= 0.1 * collected, (
        f"CONTRIBUTING says {documented} unit tests, pytest collects {collected}: update its Tests table"
    )
