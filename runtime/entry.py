"""Entry point of one role process: `python -m runtime.entry --run-dir D --role R --rank N`.

Reads the resolved config the launcher wrote to `D/config.yaml`, sets up the role's JSON
log, imports the role class lazily (so a reward process never imports vLLM) and runs it.
"""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path

from runtime.config.load import load_config
from runtime.errors import one_line
from runtime.identity.addresses import CONTROLLER_ENV
from runtime.last_words import MAX_CHARS, say
from runtime.logs import get_logger, setup_logging
from runtime.memory.gpu import TITLE_PREFIX

ROLES = {
    "controller": "roles.controller.role:Controller",
    "rollout": "roles.rollout.role:RolloutRole",
    "trainer": "roles.trainer.role:TrainerRole",
    "reward": "roles.reward.role:RewardRole",
    "reward_model": "roles.reward.model_role:RewardModelRole",
    "critic": "roles.critic.role:CriticRole",
    "teacher": "roles.teacher.role:TeacherRole",
}


def role_class(kind: str) -> type:
    module, _, name = ROLES[kind].partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tandem-role")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--role", required=True, choices=sorted(ROLES))
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--node", type=int, default=0)
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    cfg = load_config(run_dir / "config.yaml")
    setup_logging(run_dir, args.role, args.rank, level=cfg.log_level)
    _set_title(f"{TITLE_PREFIX}{args.role}-{args.rank}")
    from runtime.role import RoleContext

    ctx = RoleContext(
        cfg=cfg,
        run_dir=run_dir,
        role=args.role,
        rank=args.rank,
        node=args.node,
        controller_address=os.environ.get(CONTROLLER_ENV, ""),
        env=dict(os.environ),
    )
    try:
        role = role_class(args.role)(ctx)
    except Exception as exc:
        cause = one_line(exc, MAX_CHARS)
        say(cause)
        get_logger().error("fatal", cause=cause)
        raise SystemExit(1) from None
    role.main()


def _set_title(title: str) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
