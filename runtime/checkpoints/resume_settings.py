"""The settings a checkpoint was saved with, compared with a resume's before anything starts.

Every checkpoint's manifest records the run's settings (`settings(cfg)`: the config as
dotted keys, under `MANIFEST_KEY`). On `resume=auto`, `compare(saved, now)` splits what
changed in two; what a caller may rely on:
* `REFUSED` settings are those the saved state depends on: the group size and batch (the
  restored admission gate counts samples of the old ones, so a smaller batch admits
  nothing, forever), the vocabulary and the sequence lengths (the prompts in flight at
  the checkpoint are generated again under the new ones). A change of one of them is
  refused in one line naming each key, its saved value and its new one.
* Any other change is accepted and named (`accepted`), so a resume says in one line what
  it does differently; keys that only say where and how the run is launched (`IGNORED`)
  and the `auto` keys (chosen per machine) are neither.
* A checkpoint saved without settings (before they were recorded) compares as equal.
"""

from __future__ import annotations

from typing import Any

import msgspec

from runtime.config import RunConfig
from runtime.config.load import AUTO_KEYS

MANIFEST_KEY = "settings"
REFUSED = {
    "rollout.n": "the group size",
    "trainer.prompts_per_step": "the batch",
    "model.tiny.vocab_size": "the vocabulary",
    "rollout.max_tokens": "a sequence length",
    "rollout.engine.max_model_len": "a sequence length",
    "rollout.max_total_tokens": "a sequence length",
    "data.max_prompt_tokens": "a sequence length",
}
IGNORED = {"run_dir", "resume", "startup_timeout_s", "shutdown_timeout_s", *AUTO_KEYS}


def settings(cfg: RunConfig) -> dict[str, Any]:
    """The run's settings as `{dotted.key: value}` (lists and mappings kept whole)."""
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node and prefix.count(".") < 4:
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = node

    walk(msgspec.to_builtins(cfg), "")
    return flat


def compare(saved: dict[str, Any] | None, now: dict[str, Any]) -> tuple[str, str]:
    """(refused, accepted): one line each, "" when there is nothing to say."""
    if not saved:
        return "", ""
    changed = [k for k in sorted(set(saved) | set(now)) if k not in IGNORED and saved.get(k) != now.get(k)]
    refused = [f"{k} {_shown(saved.get(k))} -> {_shown(now.get(k))} ({REFUSED[k]})" for k in changed if k in REFUSED]
    accepted = [f"{k} {_shown(saved.get(k))} -> {_shown(now.get(k))}" for k in changed if k not in REFUSED]
    refusal = ""
    if refused:
        refusal = (
            "the checkpoint's saved state depends on settings this run changes: "
            + "; ".join(refused)
            + " (resume with the saved values, or start over with resume=fresh)"
        )
    return refusal, ", ".join(accepted)


def _shown(value: Any) -> str:
    text = "unset" if value is None else str(value)
    return text if len(text) <= 60 else text[:57] + "..."
