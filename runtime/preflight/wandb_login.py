"""Whether `metrics.wandb=true` can log in, asked at launch before any role starts.

`wandb_login_problem()` returns None when wandb would start a run without asking: offline
or disabled (`WANDB_MODE`, `wandb offline`, `WANDB_DISABLED`), or credentials found where
`wandb.init` looks for them (`WANDB_API_KEY`, `~/.netrc` from `wandb login`, wandb's
settings); otherwise one line saying how to log in or run offline. It asks wandb itself
(its settings and its credential lookup, without prompting and without network), so it
agrees with what `wandb.init` would do in the controller; if this wandb has no such API,
it trusts the setup (returns None) rather than refuse a run it cannot judge.
"""

from __future__ import annotations

import os

from runtime.errors import one_line

OFFLINE_MODES = ("offline", "disabled", "dryrun")


def wandb_login_problem() -> str | None:
    if os.environ.get("WANDB_MODE", "").lower() in OFFLINE_MODES or _truthy(os.environ.get("WANDB_DISABLED", "")):
        return None
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib.wbauth import authenticate_session
    except ImportError:
        return None
    try:
        settings = wandb_setup.singleton().settings
        if settings.mode in OFFLINE_MODES:
            return None
        auth = authenticate_session(host=settings.base_url, source="tandem", prompt=False, update_session=False)
    except Exception as exc:  # a key of the wrong format, an unreadable netrc: wandb.init would fail too
        return f"metrics.wandb=true: wandb cannot log in ({one_line(exc, line=0)})"
    if auth is not None:
        return None
    return (
        f"metrics.wandb=true but wandb has no API key for {settings.base_url}: run `.venv/bin/wandb login` "
        "(or set WANDB_API_KEY), or log offline with WANDB_MODE=offline"
    )


def _truthy(value: str) -> bool:
    return value.lower() in ("1", "true", "yes")
