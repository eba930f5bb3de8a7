"""A checkpoint is complete only with every part its run writes: the manifest check alone
vouched only for the files that were there (a PPO checkpoint whose
critic shards lay in the wrong folder passed it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.checkpoints import checkpoint
from runtime.config.load import load_config


def write_checkpoint(run_dir: Path, step: int, parts: list[str]) -> Path:
    tmp = checkpoint.begin(run_dir, step)
    for rel in parts:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(b"x" * 8)
    return checkpoint.commit(tmp, step, {"version": step})


def test_required_parts_follow_the_run() -> None:
    grpo = load_config("configs/tiny_cpu.yaml", [])
    ppo = load_config("configs/ppo_hybridflow.yaml", [])
    assert checkpoint.required_parts(grpo) == ["controller.json", "actor/", "hf/"]
    assert checkpoint.required_parts(ppo) == ["controller.json", "actor/", "critic/", "hf/"]


def test_a_checkpoint_missing_a_part_is_skipped_for_the_previous_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ppo = load_config("configs/ppo_hybridflow.yaml", [f"run_dir={tmp_path}"])
    full = ["controller.json", "actor/.metadata", "critic/.metadata", "hf/model.safetensors"]
    write_checkpoint(tmp_path, 2, full)
    # The critic's shards beside the actor's, not under critic/: what the critic role wrote.
    broken = write_checkpoint(tmp_path, 4, ["controller.json", "actor/.metadata", ".metadata", "hf/model.safetensors"])
    found = checkpoint.find_latest(tmp_path, required=checkpoint.required_parts(ppo))
    assert found is not None and found[0].name == "step-00000002"
    assert f"skipping checkpoint {broken}: no critic part" in capsys.readouterr().out
    assert checkpoint.find_latest(tmp_path)[0] == broken  # type: ignore[index]  # without parts: the old check
    with pytest.raises(ValueError, match="no critic part"):
        checkpoint.validate(broken, checkpoint.required_parts(ppo))
