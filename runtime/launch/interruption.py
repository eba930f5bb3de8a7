"""What the launcher says when a run is stopped from outside (SIGTERM, SIGINT): which
checkpoint the run can continue from, and the exact command that continues it.

`resume_command(cfg)` is this launch's own command line (as typed, `resume=` replaced by
`resume=auto`), or, when the launcher was not started from the command line,
`tandem launch RUN_DIR/config.yaml resume=auto`. `interrupted_lines(run_dir, signal,
since)` are the console lines of the end: the checkpoint saved for the interruption (one
whose manifest was written after `since`), else the last one before it, else none; then
the resume command.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

from runtime.checkpoints import checkpoint
from runtime.config import RunConfig
from runtime.views.summary import last_step


def resume_command(cfg: RunConfig, argv: list[str] | None = None) -> str:
    """The command that continues this run (see the module docstring)."""
    argv = sys.argv if argv is None else argv
    if len(argv) < 3 or argv[1] != "launch":
        return shlex.join(["tandem", "launch", str(Path(cfg.run_dir) / "config.yaml"), "resume=auto"])
    prog = argv[0] if Path(argv[0]).name == "tandem" else f"{sys.executable} -m runtime.cli"
    args = [a for a in argv[2:] if not a.startswith("resume=")]
    if not any(a.startswith("run_dir=") for a in args):
        args.append(f"run_dir={cfg.run_dir}")
    return " ".join([shlex.quote(prog) if prog == argv[0] else prog, "launch", *map(shlex.quote, args), "resume=auto"])


def interrupted_lines(cfg: RunConfig, how: str, since: float) -> tuple[list[str], dict[str, Any]]:
    """The end's console lines and the fields of its log event (see the module docstring);
    `how`: the signal's name, `since`: when it came (Unix time)."""
    run_dir = Path(cfg.run_dir)
    found = checkpoint.find_latest(run_dir, quiet=True)
    step = last_step(run_dir).get("step", 0)
    trained = step if isinstance(step, int) else 0
    command = resume_command(cfg)
    fields: dict[str, Any] = {"signal": how, "trained_steps": trained, "resume": command}
    if found is None:
        head = f"interrupted ({how}) after {trained} step(s): no checkpoint"
        head += ", nothing was trained" if not trained else " was saved (the run starts over when resumed)"
    else:
        path, manifest = found
        fields.update(checkpoint=str(path), checkpoint_step=manifest["step"])
        if float(manifest.get("created", 0.0)) >= since:
            head = f"interrupted ({how}) at step {manifest['step']}: saved checkpoint {path}"
        else:
            head = (
                f"interrupted ({how}) after {trained} step(s): no checkpoint of them was saved in time; "
                f"the last is {path} (step {manifest['step']})"
            )
    return [head, f"resume with: {command}"], fields
