"""A recipe for a real model does not silently train a random one: configs/grpo_gsm8k.yaml
(and gsm8k_tool.yaml on top of it) leave `model.path` `???`, and a launch without it is
refused in one line naming `model.path`, exit 2, before anything is made. The tiny random
model stays the default of the recipes made for it (each says so in its opening comment), and
`model.path=tiny` asks for it."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from runtime.config.load import check_set, unset_keys
from runtime.errors import ConfigError
from runtime.memory.auto import load_settled
from tests.conftest import ROOT

TINY_RECIPES = ("tiny_cpu", "multiturn_tiny_cpu", "multiturn_tool_sleep_cpu", "reward_model_tiny_cpu",
                "ppo_hybridflow", "ppo_hybridflow_megatron")  # fmt: skip
REAL_MODEL_RECIPES = ("grpo_gsm8k", "gsm8k_tool")


@pytest.mark.parametrize("name", REAL_MODEL_RECIPES)
@pytest.mark.parametrize("flags", [[], ["--plan"], ["--plan", "memory.gpu_gb=80"]])
def test_a_real_model_recipe_without_model_path_is_refused(tmp_path: Path, name: str, flags: list[str]) -> None:
    recipe = ROOT / "configs" / f"{name}.yaml"
    cmd = [sys.executable, "-m", "runtime.cli", "launch", str(recipe), *flags]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"tandem: error: model.path is not set: {recipe} leaves it ???")
    assert "model.path=tiny" in done.stderr and done.stderr.count("\n") == 1
    assert not (tmp_path / "runs").exists(), "nothing is made"
    assert time.monotonic() - started < 30  # refused before any model is built or engine started


@pytest.mark.parametrize("name", REAL_MODEL_RECIPES)
def test_model_path_given_or_tiny_by_name_is_accepted(name: str) -> None:
    recipe = ROOT / "configs" / f"{name}.yaml"
    assert unset_keys(load_settled(recipe)) == ["model.path"]
    given = load_settled(recipe, ["model.path=/models/Qwen2.5-1.5B-Instruct"])
    check_set(given, recipe)
    tiny = load_settled(recipe, ["model.path=tiny"])
    check_set(tiny, recipe)
    assert tiny.model.path == ""  # the tiny model, made under the run directory


@pytest.mark.parametrize("name", TINY_RECIPES)
def test_the_recipes_made_for_the_tiny_model_keep_it_as_their_default(name: str) -> None:
    cfg = load_settled(ROOT / "configs" / f"{name}.yaml")
    check_set(cfg, name)
    assert cfg.model.path == ""


def says_it_trains_a_random_model(recipe: Path) -> bool:
    """The recipe's opening comment (or its base's) says its model is the tiny or a random one."""
    lines = recipe.read_text().splitlines()
    head = "\n".join(itertools.takewhile(lambda line: line.startswith("#") or not line.strip(), lines))
    if re.search(r"\b(tiny|random)", head, re.I):
        return True
    base = yaml.safe_load(recipe.read_text()).get("base")
    return bool(base) and says_it_trains_a_random_model(recipe.parent / base)


@pytest.mark.parametrize("recipe", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_a_recipe_that_trains_a_random_model_by_default_says_so(recipe: Path) -> None:
    cfg = load_settled(recipe)
    if cfg.model.path == "" and not unset_keys(cfg):  # no model.path given: the tiny model, shaped by model.tiny
        assert says_it_trains_a_random_model(recipe), f"{recipe.name}: leave model.path ??? or say it is random"


def test_check_set_names_the_key_and_the_recipe() -> None:
    with pytest.raises(ConfigError, match=r"^model\.path is not set: my\.yaml leaves it \?\?\? for you to give"):
        check_set(load_settled(ROOT / "configs" / "grpo_gsm8k.yaml"), "my.yaml")
