"""Per-step metrics: one JSON object per trainer step appended to RUN_DIR/metrics.jsonl,
and optionally mirrored to TensorBoard and wandb (both off by default) under grouped names
(`actor/loss`, `rollout/reward_mean`: roles/controller/metric_groups.py). Validation rounds
add records of their own (`kind: "validation"`, keys `val/...`); a step's record has no
`kind`. A NaN or infinite value is written as the text "nan" / "inf" / "-inf"
(runtime/logs.py `json_ready`); TensorBoard and wandb get the float."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

from roles.controller.metric_groups import grouped
from runtime.checkpoints import checkpoint
from runtime.config import MetricsConfig
from runtime.logs import get_logger, json_ready
from runtime.role import FatalError

log = get_logger("metrics")

# Every step record has these keys: what the recorder measures itself (step_metrics.py) ...
STEP_KEYS = (
    "step",
    "policy_version",
    "reward_mean",
    "reward_std",
    "response_len_mean",
    "staleness_mean",
    "staleness_max",
    "dropped_stale",
    "samples_per_s",
    "tokens_per_s",
    "gen_busy_s",
    "train_busy_s",
    "rollout_idle_ratio",
    "trainer_idle_ratio",
)
# ... and these of the trainer's, 0.0 in a step whose trainer did not report them.
TRAINER_REQUIRED_KEYS = (
    "weight_sync_s",
    "loss",
    "kl_behaviour_proximal",
    "importance_weight_max",
    "clip_fraction",
    "entropy",
    "grad_norm",
)
REQUIRED_KEYS = (*STEP_KEYS, *TRAINER_REQUIRED_KEYS)


class MetricsSink:
    def __init__(self, path: Path, cfg: MetricsConfig, run_dir: Path, run_name: str) -> None:
        """Append to `path`; mirror to the sinks `cfg` enables (wandb: roles/controller/wandb_run.py)."""
        self.path = path
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 (lives with the controller)
        self._tb: Any = None
        self._wandb: Any = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tb"))
        if cfg.wandb:  # named by metrics.wandb_name or the run directory, not `run_name`
            from roles.controller.wandb_run import setup_wandb

            self._wandb = setup_wandb(cfg, run_dir, resumed=checkpoint.resume_dir() is not None)

    def write(self, record: dict[str, Any]) -> None:
        missing = [k for k in REQUIRED_KEYS if k not in record]
        if missing:
            raise KeyError(f"step metrics lack {missing}")
        self._append(record)
        log.info("step", **record)
        self._mirror(record)

    def write_validation(self, record: dict[str, Any]) -> None:
        """A validation round's record (`kind`, `step`, `policy_version`, `val/...`)."""
        self._append(record)
        log.info("validation", **{k.replace("/", "_").replace("@", "_at_"): v for k, v in record.items()})
        self._mirror(record)

    def _append(self, record: dict[str, Any]) -> None:
        """One line; a line that cannot be written (a full disk) ends the run naming the file."""
        try:
            self._file.write(json.dumps(json_ready(record)) + "\n")
        except OSError as exc:
            raise FatalError(f"cannot write {self.path}: {exc.strerror or exc} ({errno_name(exc)})") from None

    def _mirror(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        numeric = dashboard_values(record)
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def errno_name(exc: OSError) -> str:
    """`ENOSPC` for an OSError of errno 28 ("OSError" when it has none)."""
    return errno.errorcode.get(exc.errno or 0, "OSError")


def dashboard_values(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record as TensorBoard and wandb get them: grouped names
    (`actor/loss`, `rollout/reward_mean`: metric_groups.py), `step` left out (it is the x axis)."""
    return {
        grouped(k): v
        for k, v in record.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"
    }
