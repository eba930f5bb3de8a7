"""The "Environments and tools" example (docs/rollout.md) works as printed: its environment file,
imported as `myenv`, runs through the real episode loop (feedback after turn one, reward
for turn two), and its launch command's config passes the launch-time checks."""

from __future__ import annotations

import asyncio
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from roles.rollout.environment import EnvPrompt
from roles.rollout.episode import run_episode
from runtime.config.load import load_config
from runtime.preflight.environment import check_launch
from runtime.tiny.model import build_tokenizer
from tests.conftest import ROOT
from tests.unit.roles.rollout.test_episode import ScriptedSampler

SECTION = ROOT.joinpath("docs", "rollout.md").read_text().split("## Environments and tools", 1)[1].split("\n## ", 1)[0]


@pytest.fixture
def myenv(tmp_path: Path) -> Iterator[None]:
    (code,) = re.findall(r"```python\n(# myenv\.py.*?)```", SECTION, re.DOTALL)
    assert len(code.splitlines()) <= 22  # "a 20-line environment file"
    (tmp_path / "myenv.py").write_text(code)
    sys.path.insert(0, str(tmp_path))
    try:
        yield
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("myenv", None)


def test_readme_environment_gives_feedback_then_rewards_turn_two(myenv: None) -> None:
    import myenv as readme_env  # type: ignore[import-not-found]

    tok = build_tokenizer()
    turn_1, turn_2 = [ord(c) for c in "abzz"], [ord(c) for c in "abcz"]
    sampler = ScriptedSampler([(turn_1, [-1.0] * 4, [0] * 4), (turn_2, [-1.0] * 4, [1] * 4)])
    prompt = EnvPrompt(prompt_ids=[ord(c) for c in "abcd"], text="abcd", answer="abcd")
    traj = asyncio.run(
        run_episode(readme_env.factory(), prompt, sampler, max_turns=4, max_tokens=4, max_total_tokens=64,
                    call_timeout_s=1.0, tokenizer=tok)
    )  # fmt: skip
    feedback = tok.encode("\nscore 2/4, copy: abcd\n", add_special_tokens=False)
    assert traj.token_ids == turn_1 + feedback + turn_2
    assert traj.loss_mask == [1] * 4 + [0] * len(feedback) + [1] * 4
    assert (traj.num_turns, traj.reward) == (2, 0.75)


def test_readme_launch_command_passes_the_launch_checks(myenv: None) -> None:
    (command,) = [line.strip() for line in SECTION.splitlines() if "tandem launch configs/multiturn_tiny_cpu" in line]
    argv = shlex.split(command)
    config, overrides = argv[argv.index("launch") + 1], argv[argv.index("launch") + 2 :]
    assert overrides == ["rollout.env=myenv:factory"]
    check_launch(load_config(ROOT / config, overrides))
