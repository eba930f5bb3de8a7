"""The commands in the recipes' comments (configs/*.yaml) run as written in a shell that
activated nothing: they used to say `tandem ...` and `python3 benchmarks/...`, which gave
`tandem: command not found` and `No module named 'msgspec'` in a fresh shell.

A command is a comment line (joined over trailing backslashes), or a `backticked` span, whose
program (after an optional `nice -n N`) is a program name or a path. It must name the venv's
program by its path, every repository path it names must exist, a `tandem launch --plan`
(no GPU, no role) must run and exit 0, another launch's words (as the shell splits them) must
load as a config, and a benchmark script must accept the flags given."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from runtime.config.load import load_config
from tests.conftest import ROOT

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
PROGRAMS = re.compile(r"^(?:nice -n \d+ )?((?:\.venv/bin/)?(?:tandem|python3?|pip3?|bash|wandb))\s")
REPO_PATH = re.compile(r"^(?:configs|benchmarks|tests|roles|runtime)/")


def commands(config: Path) -> list[str]:
    """The commands of `config`'s comments."""
    found, pending = [], ""
    for line in config.read_text().splitlines():
        comment = line.partition("#")[2].strip() if line.lstrip().startswith("#") else ""
        text = f"{pending} {comment}".strip() if pending else comment
        pending = text[:-1].strip() if text.endswith("\\") else ""
        if pending:
            continue
        if PROGRAMS.match(text + " "):
            found.append(text.split("  #")[0].strip())
        found += [span for span in re.findall(r"`([^`]+)`", text) if PROGRAMS.match(span + " ")]
    return found


ALL = [(c.name, cmd) for c in CONFIGS for cmd in commands(c)]


def test_the_recipes_do_have_commands() -> None:
    assert len(ALL) >= 15, ALL  # the bench, gsm8k and PPO recipes' commands


@pytest.mark.parametrize(("config", "command"), ALL, ids=[f"{c}:{i}" for i, (c, _) in enumerate(ALL)])
def test_a_recipe_command_runs_as_written_in_a_fresh_shell(config: str, command: str) -> None:
    program = PROGRAMS.match(command + " ").group(1)  # type: ignore[union-attr]
    assert program.startswith(".venv/bin/"), f"{config}: write .venv/bin/{program.split('/')[-1]}: {command}"
    assert (ROOT / program).exists(), f"{config}: {program} does not exist"
    argv = shlex.split(command.removeprefix(command[: command.index(program)]))
    for arg in argv[1:]:
        value = arg.partition("=")[2] if "=" in arg else arg
        if REPO_PATH.match(value) and not value.startswith("benchmarks/results/"):
            assert (ROOT / value).exists(), f"{config}: {value} does not exist: {command}"
    fresh = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    fresh |= {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}  # a worktree's checkout
    if argv[1:3] == ["launch", "--plan"]:
        out = subprocess.run(argv, cwd=ROOT, env=fresh, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"{config}: {command}\n{out.stderr[-2000:]}"
    elif argv[1:2] == ["launch"]:
        load_config(ROOT / argv[2], argv[3:])  # a ConfigError names the word the shell split badly
    elif len(argv) > 1 and argv[1].startswith("benchmarks/"):
        out = subprocess.run([*argv[:2], "--help"], cwd=ROOT, env=fresh, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"{config}: {command}\n{out.stderr[-2000:]}"
        flags = [a.split("=")[0] for a in argv[2:] if a.startswith("--")]
        assert all(f in out.stdout for f in flags), (flags, out.stdout)
