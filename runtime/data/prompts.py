"""Prompts as the run tokenizes them, shared by the controller's dataset and the launcher's
check (one encoding, so both count the same tokens).

`encode(raw, tokenizer, cfg)` is a prompt's token ids, text and chat messages (the chat
template applied when `data.chat_template` and the tokenizer has one); `prompt_limit(cfg)` the
longest prompt a run can take: `data.max_prompt_tokens`, and at most `rollout.engine.max_model_len - 1`
(vLLM refuses a prompt that leaves no room for one generated token).

`check_prompt_lengths(cfg, tokenizer)` (the launcher, before any role starts) raises
`ConfigError` in one line when no prompt of the training data (or of `validation.data`)
fits `prompt_limit`; it stops at the first prompt that fits, so a good dataset costs one
row's tokenization. Prompts over the limit in a dataset that has some that fit are
skipped while the run draws them: counted in metrics (`prompts_skipped_too_long`) and
logged once per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runtime.config import DataConfig, RunConfig
from runtime.data.data_files import read_rows
from runtime.data.task_sources import source_rows
from runtime.errors import ConfigError


def encode(raw: Any, tokenizer: Any, cfg: DataConfig) -> tuple[list[int], str, list[dict[str, Any]]]:
    """A prompt's token ids, its text, and its chat messages (before any template)."""
    messages = raw if isinstance(raw, list) else [{"role": "user", "content": str(raw)}]
    if not cfg.render_prompt:  # the rollout's agent renders it (data.render_prompt=false)
        return [], "\n".join(str(m.get("content", "")) for m in messages), messages
    if cfg.chat_template and getattr(tokenizer, "chat_template", None):
        if cfg.system_prompt and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = "\n".join(str(m.get("content", "")) for m in messages)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]), text, messages


def prompt_limit(cfg: RunConfig) -> int:
    """The most tokens a prompt of this run may have (see the module docstring)."""
    return min(cfg.data.max_prompt_tokens, cfg.rollout.engine.max_model_len - 1)


def limit_text(cfg: RunConfig) -> str:
    """Which setting sets `prompt_limit`, for messages."""
    d, e = cfg.data.max_prompt_tokens, cfg.rollout.engine.max_model_len
    if d <= e - 1:
        return f"data.max_prompt_tokens={d}"
    return f"rollout.engine.max_model_len={e} (a prompt needs room for one generated token)"


def check_prompt_lengths(cfg: RunConfig, tokenizer: Any) -> None:
    """ConfigError when no training (or validation) prompt fits (see the module docstring)."""
    d = cfg.data
    what = {"file": "data.path", "synthetic": "the synthetic data"}.get(d.source, f"the {d.source} data")
    _some_fit(source_rows(d, cfg.seed), tokenizer, cfg, what)
    v = cfg.validation
    if v.every:
        if v.data == "synthetic":
            return  # the same task as the training data's, of another seed
        rows = read_rows(v.data, d.prompt_key, "validation.data", d.max_row_bytes)
        _some_fit(rows[: v.max_prompts or len(rows)], tokenizer, cfg, "validation.data")


def _some_fit(rows: Sequence[dict[str, Any]], tokenizer: Any, cfg: RunConfig, what: str) -> None:
    limit, shortest = prompt_limit(cfg), None
    for row in rows:
        n = len(encode(row.get(cfg.data.prompt_key, ""), tokenizer, cfg.data)[0])
        if n <= limit:
            return
        shortest = n if shortest is None else min(shortest, n)
    raise ConfigError(
        f"every prompt of {what} ({len(rows)} rows) is longer than {limit_text(cfg)}: the shortest has "
        f"{shortest} tokens; raise the limit or shorten the prompts"
    )
