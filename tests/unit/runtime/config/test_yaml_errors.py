"""A recipe that is not valid YAML, or that gives a key twice, fails in one line as
FILE:LINE:COLUMN: problem (exit 2, before anything starts); an override with bad syntax
is refused naming the override."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runtime.config.load import load_config
from runtime.errors import ConfigError
from tests.conftest import ROOT


def launch(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "runtime.cli", "launch", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)


def recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "x.yaml"
    path.write_text(text)
    return path


def test_a_yaml_syntax_error_names_file_line_and_column_in_one_line(tmp_path: Path) -> None:
    path = recipe(tmp_path, "name: x\nrollout:\n  n: 4\ntrainer:\n  total_steps: 2\n  optim:\n  lr: bad: 1\n")
    done = launch(str(path), f"run_dir={tmp_path / 'run'}")
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"tandem: error: {path}:7:10: mapping values are not allowed here\n"
    assert not (tmp_path / "run").exists()


UNCLOSED = "expected ',' or ']', but got '<stream end>' (while parsing a flow sequence at 2:9)"
TAB = "found character '\\t' that cannot start any token (while scanning for the next token)"


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        ("rollout:\n  stop: [a, b\n", "3:1", UNCLOSED),
        ("rollout:\n\tn: 4\n", "2:1", TAB),
        ("rollout:\n  n: 4\n  max_tokens: 8\n  n: 8\n", "4:3", "duplicate key 'n' (first given on line 2)"),
    ],
)
def test_every_kind_of_bad_recipe_names_its_position(tmp_path: Path, text: str, where: str, problem: str) -> None:
    path = recipe(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}:{where}: {problem}"


def test_a_duplicate_key_in_a_base_layer_names_the_base_file(tmp_path: Path) -> None:
    base = tmp_path / "base.yaml"
    base.write_text("trainer:\n  total_steps: 4\n  total_steps: 8\n")
    top = recipe(tmp_path, "base: base.yaml\nname: top\n")
    with pytest.raises(ConfigError, match=rf"^{base}:3:3: duplicate key 'total_steps'"):
        load_config(top)


def test_keys_overriding_a_yaml_merge_are_not_duplicates(tmp_path: Path) -> None:
    path = recipe(tmp_path, "rollout:\n  engine:\n    <<: {max_num_seqs: 4, max_model_len: 128}\n    max_num_seqs: 8\n")
    assert load_config(path).rollout.engine.max_num_seqs == 8


def test_an_override_whose_value_is_broken_yaml_names_the_override(tmp_path: Path) -> None:
    done = launch("configs/tiny_cpu.yaml", "reward.functions=[roles.reward.builtin:copy_task")
    assert done.returncode == 2
    assert done.stderr.startswith(
        "tandem: error: override 'reward.functions=[roles.reward.builtin:copy_task': the value is not valid YAML:"
    )
    assert done.stderr.count("\n") == 1


def test_a_bad_override_value_names_the_override_that_set_it() -> None:
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny_cpu.yaml", ["rollout.n==8"])
    assert str(err.value) == (
        "bad value for config key 'rollout.n' (got '=8') from override 'rollout.n==8': Expected `int`, got `str`"
    )
    with pytest.raises(ConfigError, match=r"from override 'reward\.functions=a,b'"):
        load_config("configs/tiny_cpu.yaml", ["reward.functions=a,b"])


def test_a_plain_string_that_merely_looks_like_yaml_is_still_a_string() -> None:
    assert load_config(None, ["data.path=a: b: c"]).data.path == "a: b: c"
