"""The arguments the wandb sink gives `wandb.init`: project, entity, group and name from
`metrics.wandb_*` (name defaults to the run directory's name), and the stored run id with
`resume="allow"` only for a run resumed from a checkpoint. The sink with real wandb:
tests/integration/test_wandb_offline.py."""

from __future__ import annotations

from pathlib import Path

from roles.controller.wandb_run import ID_FILE, choose_run_id, init_args
from runtime.config import MetricsConfig


def test_init_args_carry_project_entity_group_name_and_resume(tmp_path: Path) -> None:
    run = tmp_path / "grpo-7b"
    run.mkdir()
    cfg = MetricsConfig(wandb=True, wandb_project="p", wandb_entity="team", wandb_group="sweep-1")
    args = init_args(cfg, run, run_id="abc", resumed=False)
    assert {k: args[k] for k in ("project", "entity", "group", "name", "id")} == {
        "project": "p", "entity": "team", "group": "sweep-1", "name": "grpo-7b", "id": "abc"
    }  # fmt: skip
    assert "resume" not in args
    assert init_args(MetricsConfig(wandb_name="mine"), run, run_id="x", resumed=True)["resume"] == "allow"
    assert init_args(MetricsConfig(), run, run_id="x", resumed=False)["entity"] is None  # WANDB_ENTITY applies
    (run / ID_FILE).write_text("old\n")
    assert choose_run_id(run, resumed=True, new_id="new") == "old"
    assert choose_run_id(run, resumed=False, new_id="new") == "new"
