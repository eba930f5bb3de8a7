"""Config mistakes a newcomer makes get a line that says where and what to write: a bad value
in a recipe names the file and line of the layer that set it; a list key given one value
says to write a list (and the line it suggests works); a mistyped key names the key it was
likely meant to be, instead of every key there."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from runtime.config.load import load_config
from runtime.errors import ConfigError
from tests.conftest import ROOT

TINY = ROOT / "configs" / "tiny_cpu.yaml"


def error_of(path: Path | None, *overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, list(overrides))
    assert "\n" not in str(err.value)
    return str(err.value)


def test_a_bad_value_in_a_recipe_names_its_file_and_line(tmp_path: Path) -> None:
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(f"base: {TINY}\nrollout:\n  n: many\n")
    assert error_of(recipe).startswith(f"{recipe}:3: bad value for config key 'rollout.n' (got 'many')")
    recipe.write_text(f"base: {TINY}\nplacement:\n  - {{role: controller}}\n  - {{role: trainer, count: two}}\n")
    assert error_of(recipe).startswith(f"{recipe}:4: bad value for config key 'placement.1.count'")
    assert error_of(recipe, "rollout.n=3").startswith(f"{recipe}:4: ")  # an override elsewhere changes nothing


def test_the_layer_that_set_the_bad_value_is_named(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text("seed: 1\ntrainer:\n  total_steps: lots\nrollout:\n  n: 2\n")
    child = tmp_path / "child.yaml"
    child.write_text("base: base.yaml\nrollout:\n  n: 4\n")
    assert error_of(child).startswith(f"{tmp_path / 'base.yaml'}:3: bad value for config key 'trainer.total_steps'")
    child.write_text("base: base.yaml\ntrainer:\n  total_steps: 3\nrollout:\n  n: [4]\n")
    assert error_of(child).startswith(f"{child}:5: bad value for config key 'rollout.n'")


def test_an_override_names_itself_not_the_recipe(tmp_path: Path) -> None:
    message = error_of(TINY, "rollout.n=many")
    assert message.startswith("bad value for config key 'rollout.n'") and "from override 'rollout.n=many'" in message


def test_one_value_for_a_list_key_says_to_write_a_list_and_that_works() -> None:
    message = error_of(TINY, "reward.functions=arith_reward:arith")
    assert message.endswith("; write a list: 'reward.functions=[arith_reward:arith]'"), message
    (suggested,) = shlex.split(message.rpartition("write a list: ")[2])
    assert load_config(TINY, [suggested]).reward.functions == ["arith_reward:arith"]


def test_one_value_for_a_list_key_in_a_recipe_says_to_write_a_list(tmp_path: Path) -> None:
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(f"base: {TINY}\nreward:\n  functions: my_reward:score\n")
    assert error_of(recipe) == (
        f"{recipe}:3: bad value for config key 'reward.functions' (got 'my_reward:score'): "
        "Expected `array`, got `str`; write a list: [my_reward:score]"
    )


@pytest.mark.parametrize(
    ("override", "meant"),
    [
        ("rollout.nn=3", "'rollout.n'"),
        ("rollout.max_stalenes=3", "'rollout.max_staleness'"),
        ("trainer.max_staleness=3", "'rollout.max_staleness'"),  # the right name in another section
        ("trainer.optim.lrr=1e-6", "'trainer.optim.lr'"),
        ("trainer.total_step=5", "'trainer.total_steps'"),
    ],
)
def test_a_mistyped_key_gets_did_you_mean_instead_of_every_key(override: str, meant: str) -> None:
    message = error_of(TINY, override)
    assert "did you mean" in message and meant in message, message
    assert "valid keys under" not in message


def test_a_mistyped_key_in_a_recipe_names_its_line_and_the_near_key(tmp_path: Path) -> None:
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(f"base: {TINY}\nrollout:\n  n: 4\n  max_stalness: 2\n")
    assert (
        error_of(recipe)
        == f"{recipe}:4: unknown config key 'rollout.max_stalness'; did you mean 'rollout.max_staleness'?"
    )


def test_a_key_near_nothing_still_lists_the_keys_there() -> None:
    message = error_of(TINY, "rollout.engine.zzzz=1")
    assert "valid keys under rollout.engine: " in message and "max_model_len" in message
