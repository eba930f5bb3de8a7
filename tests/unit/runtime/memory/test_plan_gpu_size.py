"""`tandem launch --plan` on a machine without the recipe's GPU says which GPU size the run
needs (the smallest usual size its plan fits, with `auto`'s choices for it) and the command
that shows that plan; and the bench recipes' comments give the model size the plan computes."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.memory.auto import load_settled
from runtime.memory.estimate import count_text, model_shape
from runtime.memory.plan import smallest_gpu_gb
from tests.conftest import ROOT

BENCH = sorted((ROOT / "configs").glob("bench_*.yaml"))


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "runtime.cli", "launch", "--plan", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(smallest_gpu_gb() > 0, reason="this machine has a GPU: its size is known")
@pytest.mark.parametrize(
    ("recipe", "gpu", "needs", "less"),
    # With FSDP2's full offload (slow: the plan's trainer step line says how slow) the 1.5B recipe
    # fits an L4 and the full-parameter 7B one an H100.
    [("bench_1.5b", "24 GB (L4)", 24.1, 16), ("bench_7b", "80 GB (H100, A100 80GB)", 85.5, 48.3)],
)
def test_a_plan_without_a_gpu_size_names_the_gpu_the_run_needs(
    recipe: str, gpu: str, needs: float, less: float
) -> None:
    done = plan(f"configs/{recipe}.yaml")
    assert done.returncode == 0, done.stderr
    note = done.stdout.splitlines()[-1]
    assert note.startswith("note: no GPU size is known here") and f"it needs {gpu} GPUs ({needs} GB)" in note, note
    command = re.search(r": (tandem launch --plan .*) shows that plan$", note)
    assert command is not None and command.group(1).endswith(f"memory.gpu_gb={needs}")
    suggested = plan(*shlex.split(command.group(1))[3:])
    assert suggested.returncode == 0 and f"of {needs} GB, fits" in suggested.stdout
    smaller = plan(f"configs/{recipe}.yaml", f"memory.gpu_gb={less}")  # the next usual size down
    assert smaller.returncode == 2 and "DOES NOT FIT" in smaller.stdout


def test_a_plan_with_a_gpu_size_or_without_gpus_has_no_such_note() -> None:
    assert "it needs" not in plan("configs/bench_1.5b.yaml", "memory.gpu_gb=80").stdout
    assert "note: no GPU size" not in plan("configs/tiny_cpu.yaml").stdout


@pytest.mark.parametrize("recipe", BENCH, ids=lambda p: p.stem)
def test_the_bench_recipes_comments_give_the_models_size_as_the_plan_does(recipe: Path) -> None:
    shape = model_shape(load_settled(recipe, ["memory.gpu_gb=141"]))
    text = "\n".join(line for line in recipe.read_text().splitlines() if line.lstrip().startswith("#"))
    for count in re.findall(r"(\d+\.\d+B)(?: parameters| model|-parameter)", text):
        assert count == count_text(shape.num_params), (recipe.name, count)
    for gb in re.findall(r"(\d+\.\d+) GB of bf16 weights", text):
        assert float(gb) == round(shape.num_params * 2 / 1e9, 2), (recipe.name, gb)
