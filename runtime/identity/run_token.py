"""The run's secret: what every role presents to prove it belongs to this run.

`RUN_DIR/keys/run_token` holds 32 random bytes as hex, readable by the owner only
(mode 0600). The launcher makes it before any role starts (`ensure_token`), `tandem keys`
makes it beside the CurveZMQ keys, and every node of a run must have the same one (copy
`RUN_DIR/keys` to every node, as for Curve). Roles present it at registration and on
every weight update; the controller and the rollouts refuse what lacks it, so another
process of the same user cannot register, declare a role dead or send weights.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

TOKEN_FILE = "run_token"


def token_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "keys" / TOKEN_FILE


def ensure_token(run_dir: str | Path) -> str:
    """The run's token, made (mode 0600) if there is none yet."""
    path = token_path(run_dir)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return read_token(run_dir)


def read_token(run_dir: str | Path) -> str:
    """The run's token; raises FileNotFoundError naming the file when it is missing."""
    path = token_path(run_dir)
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise FileNotFoundError(f"no run token at {path} (made by `tandem launch` or `tandem keys`)") from None


def matches(presented: str, token: str) -> bool:
    """Constant-time comparison; an empty token never matches."""
    return bool(presented) and hmac.compare_digest(presented.encode(), token.encode())
