"""The wandb run a Tandem run logs to (`metrics.wandb: true`).

What a caller may rely on: a run directory has one wandb run. Its id is written to
`RUN_DIR/wandb_run_id` before `wandb.init`; a run that resumes from a checkpoint
(`resume=auto`) passes that id with `resume="allow"`, so its steps continue the same wandb
run; a run that starts at step 0 (a new run, `resume=fresh`) gets a new id. Project,
entity, group and name come from `metrics.wandb_*` (name: the run directory's name unless
set); the resolved config (RUN_DIR/config.yaml) is the wandb run's config. wandb's own
environment variables (WANDB_MODE=offline, WANDB_API_KEY, WANDB_ENTITY ...) apply as usual.
"""

from __future__ import annotations

import secrets
import string
from pathlib import Path
from typing import Any

import yaml

from runtime.config import MetricsConfig

ID_FILE = "wandb_run_id"


def stored_run_id(run_dir: Path) -> str | None:
    """The wandb run id recorded in `run_dir` (None when there is none)."""
    try:
        text = (run_dir / ID_FILE).read_text().strip()
    except OSError:
        return None
    return text or None


def init_args(cfg: MetricsConfig, run_dir: Path, *, run_id: str, resumed: bool) -> dict[str, Any]:
    """The keyword arguments of `wandb.init` for this run (no side effects). `resumed`: the
    run continues a checkpoint of the run that logged to `run_id`."""
    args: dict[str, Any] = {
        "project": cfg.wandb_project,
        "entity": cfg.wandb_entity or None,
        "group": cfg.wandb_group or None,
        "name": cfg.wandb_name or run_dir.resolve().name,
        "id": run_id,
        "dir": str(run_dir),
        "config": _resolved_config(run_dir),
    }
    if resumed:
        args["resume"] = "allow"
    return args


def choose_run_id(run_dir: Path, *, resumed: bool, new_id: str) -> str:
    """The stored id when the run resumes and one is stored, else `new_id`."""
    stored = stored_run_id(run_dir)
    return stored if resumed and stored else new_id


def new_run_id() -> str:
    """A fresh id in wandb's own format (8 characters of [a-z0-9])."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def setup_wandb(cfg: MetricsConfig, run_dir: Path, *, resumed: bool) -> Any:
    """Start (or continue) the run's wandb run; returns wandb's Run."""
    import wandb

    run_id = choose_run_id(run_dir, resumed=resumed, new_id=new_run_id())
    (run_dir / ID_FILE).write_text(run_id + "\n")
    return wandb.init(**init_args(cfg, run_dir, run_id=run_id, resumed=resumed))


def _resolved_config(run_dir: Path) -> dict[str, Any] | None:
    try:
        loaded = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return loaded if isinstance(loaded, dict) else None
