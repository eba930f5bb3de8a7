"""Checkpoints, controller side: every trainer and critic rank saves its shards, the
controller its state (`ControllerState`); then the folder is committed (runtime/checkpoints/checkpoint.py).
Taken between steps, so no batch is in training; see docs/running.md, "Checkpoints, resume, export".
A save that fails (a rank's error, its timeout, a write of the controller's own) ends the
run at once with `FatalError` naming the folder, the cause and the last intact checkpoint
(runtime/checkpoints/checkpoint.py `save_failure`); the checkpoints before it stay as they were."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

from roles.controller import state as cstate
from roles.controller.ranks import RankGroup
from runtime.checkpoints import checkpoint, resume_settings
from runtime.checkpoints.base_model import MANIFEST_KEY as BASE_MODEL_KEY
from runtime.errors import one_line
from runtime.logs import get_logger
from runtime.role import FatalError
from transport import wire
from transport.rpc import RemoteError, RequestTimeout

log = get_logger("controller")


class Checkpointer:
    def __init__(
        self,
        run_dir: Path,
        ranks: list[RankGroup],
        snapshot: Callable[[], cstate.ControllerState],
        *,
        keep: int,
        timeout_s: float,
        base_model: dict[str, str] | None = None,
        settings: dict[str, object] | None = None,
    ) -> None:
        """`ranks`: the groups whose ranks save shards (trainer, critic); `snapshot()`:
        the controller's state now; `base_model`: the run's model identity
        (runtime/checkpoints/base_model.py), and `settings` the run's settings
        (runtime/checkpoints/resume_settings.py), recorded in every manifest."""
        self.run_dir = run_dir
        self.ranks = ranks
        self.snapshot = snapshot
        self.keep = keep
        self.timeout_s = timeout_s
        self.base_model = base_model
        self.settings = settings
        self.last_step = -1  # the step of the newest checkpoint this process saved

    async def save(self, timeout_s: float | None = None) -> Path:
        """Checkpoint the run as it is now; `timeout_s` bounds the ranks' saves (default:
        `checkpoint.timeout_s`). A failure is a FatalError (see the module docstring)."""
        started = time.perf_counter()
        state = self.snapshot()
        step = state.ledger.step
        try:
            final = await self._save(state, step, self.timeout_s if timeout_s is None else timeout_s)
        except (RemoteError, RequestTimeout, ConnectionError, OSError) as exc:
            cause = exc.message if isinstance(exc, RemoteError) else one_line(exc)
            raise FatalError(checkpoint.save_failure(self.run_dir, step, " ".join(cause.split()))) from None
        self.last_step = step
        log.info("checkpoint_saved", step=step, path=str(final), seconds=round(time.perf_counter() - started, 3))
        return final

    async def _save(self, state: cstate.ControllerState, step: int, timeout_s: float) -> Path:
        tmp = checkpoint.begin(self.run_dir, step)
        save = wire.SaveCheckpoint(step=step, directory=str(tmp))
        await asyncio.gather(*[group.call(save, timeout_s) for group in self.ranks if len(group)])
        (tmp / "controller.json").write_bytes(cstate.encode(state))
        version = state.ledger.gate["version"]
        meta: dict[str, object] = {"version": version}
        if self.base_model is not None:
            meta[BASE_MODEL_KEY] = self.base_model
        if self.settings is not None:
            meta[resume_settings.MANIFEST_KEY] = self.settings
        return checkpoint.commit(tmp, step, meta, keep=self.keep)


def truncate_metrics(path: Path, step: int) -> float:
    """Keep `path` (metrics.jsonl) up to `step` (later lines are redone on resume);
    returns the last kept line's wall time."""
    if not path.exists():
        return 0.0
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))
    return float(json.loads(kept[-1])["wall_s"]) if kept else 0.0
