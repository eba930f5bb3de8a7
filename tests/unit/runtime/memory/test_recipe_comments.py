"""Each bench recipe's header says what `auto` chooses at the sizes nvidia-smi reports for an H100
80GB (85.52 GB) and an H200 141GB (150.76 GB), and may add others (`# auto at N GB[, sync]:` lines):
the plan must choose exactly that, so the comments cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from runtime.config.load import AUTO_KEYS
from runtime.memory.auto import _get, _text, load_settled
from tests.conftest import ROOT

RECIPES = ["bench_1.5b", "bench_3b", "bench_7b_lora", "bench_7b"]
LINE = re.compile(r"^#\s+auto at ([\d.]+) GB(, sync)?: (.+)$")


def _claims(recipe: str) -> list[tuple[str, bool, str]]:
    text = (ROOT / "configs" / f"{recipe}.yaml").read_text()
    return [(m[1], bool(m[2]), m[3]) for m in map(LINE.match, text.splitlines()) if m]


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_recipes_stated_auto_choices_are_the_plans(recipe: str) -> None:
    claims = _claims(recipe)
    assert {(gpu, sync) for gpu, sync, _ in claims} >= {(g, s) for g in ("85.52", "150.76") for s in (False, True)}
    for gpu, sync, said in claims:
        overrides = [f"memory.gpu_gb={gpu}", "memory.host_gb=128", *(["rollout.max_staleness=0"] if sync else [])]
        cfg = load_settled(Path(ROOT / "configs" / f"{recipe}.yaml"), overrides)
        values = dict(token.split("=", 1) for token in said.split() if "=" in token)
        levers = {token for token in said.split() if "=" not in token}
        for key, value in values.items():
            assert _text(_get(cfg, key)) == value, (recipe, gpu, sync, key)
        on = {key for key in AUTO_KEYS if _get(cfg, key) is True}
        assert levers == on, (recipe, gpu, sync)
