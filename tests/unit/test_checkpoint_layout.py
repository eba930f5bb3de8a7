"""A Megatron checkpoint resumes only with the layout it was saved with: the launcher reads
`actor/megatron-layout.json` (and the critic's) before any process starts and refuses
another TP / PP / world size, or a checkpoint an FSDP engine wrote, in one line (the
`tandem launch` refusal needs a GPU node: tests/gpu/test_megatron_single.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime import checkpoint
from runtime.checkpoint_layout import LAYOUT_FILE, check_resume_layout, configured_layouts
from runtime.config_load import load_config
from tests.conftest import ROOT

MEGATRON = ["trainer.backend=megatron", "trainer.device=cuda", "fsdp.use_fsdp=false"]


def fake_checkpoint(run_dir: Path, actor_layout: dict[str, int] | None, step: int = 4) -> Path:
    """A committed checkpoint with every part a run needs; the actor part as a Megatron
    engine writes it (layout file and a rank file) or, with no layout, as FSDP's."""
    tmp = checkpoint.begin(run_dir, step)
    (tmp / "controller.json").write_text("{}")
    (tmp / "actor").mkdir()
    if actor_layout is None:
        (tmp / "actor" / "extra-rank0.pt").write_bytes(b"fsdp")
    else:
        (tmp / "actor" / LAYOUT_FILE).write_text(json.dumps(actor_layout))
        (tmp / "actor" / "megatron-rank0.pt").write_bytes(b"shard")
    (tmp / "hf").mkdir()
    (tmp / "hf" / "config.json").write_text("{}")
    return checkpoint.commit(tmp, step, {"version": step})


def test_the_same_layout_resumes_and_another_is_named(tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path, {"tp": 2, "pp": 1, "world_size": 2})
    same = load_config(None, [*MEGATRON, "trainer.megatron.tensor_model_parallel_size=2"])
    assert configured_layouts(same) == {"actor": {"tp": 2, "pp": 1, "world_size": 2}}
    check_resume_layout(ckpt, same)
    other = load_config(None, [*MEGATRON, "trainer.megatron.pipeline_model_parallel_size=2"])
    with pytest.raises(ValueError, match=r"saved with TP=2 PP=1 world size 2, this run has TP=1 PP=2 world size 2"):
        check_resume_layout(ckpt, other)


def test_an_fsdp_checkpoint_is_not_resumed_by_megatron_and_fsdp_runs_are_not_checked(tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path, None)
    with pytest.raises(ValueError, match=r"has no megatron-layout\.json \(not saved by a Megatron engine\)"):
        check_resume_layout(ckpt, load_config(None, MEGATRON))
    check_resume_layout(ckpt, load_config(None, []))  # FSDP2 actor: nothing to check


def test_the_critic_part_is_checked_too(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs" / "ppo_hybridflow.yaml", ["critic.backend=megatron", "trainer.device=cuda"])
    assert configured_layouts(cfg) == {"critic": {"tp": 1, "pp": 1, "world_size": 1}}
    ckpt = fake_checkpoint(tmp_path, None)
    with pytest.raises(ValueError, match=r"critic has no megatron-layout\.json"):
        check_resume_layout(ckpt, cfg)
