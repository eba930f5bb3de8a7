"""Prompt datasets: JSONL / Parquet files or the synthetic copy task, with a resumable cursor.

`PromptDataset.next()` returns prompts in a seeded order (reshuffled each epoch when
`data.shuffle`); `state()` / `restore()` capture the cursor exactly, so a resumed run
continues with the next prompt that was not yet drawn. Prompts longer than the run's
limit (runtime/data/prompts.py `prompt_limit`: `data.max_prompt_tokens`, at most
`rollout.engine.max_model_len - 1`) are skipped, counted in `skipped_too_long` (kept in
checkpoints; `take_skipped` hands the count since its last call to the step's metrics)
and logged once per row (`prompt_too_long`). The tokenization is runtime/data/prompts.py's,
which the launcher's check shares.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from runtime.config import DataConfig
from runtime.data.prompts import encode
from runtime.data.task_sources import source_rows
from runtime.logs import get_logger

log = get_logger("controller")


@dataclass
class Prompt:
    uid: int  # position in the stream of drawn prompts (stable across resume)
    row: int  # row of the dataset
    prompt_ids: list[int]
    text: str
    answer: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)  # the prompt as chat messages, before any template


class PromptDataset:
    def __init__(self, cfg: DataConfig, tokenizer: Any, seed: int = 0, limit: int | None = None) -> None:
        """`limit`: the longest prompt taken (runtime/data/prompts.py `prompt_limit`; default
        `data.max_prompt_tokens`)."""
        self.cfg = cfg
        self.limit = cfg.max_prompt_tokens if limit is None else limit
        self.tokenizer = tokenizer
        self.seed = seed
        self.rows = source_rows(cfg, seed)
        if not self.rows:
            raise ValueError("the synthetic dataset is empty (data.synthetic_num_prompts)")
        self.epoch = 0
        self.position = 0
        self.drawn = 0
        self.skipped_too_long = 0
        self._unreported = 0  # skipped since the last take_skipped
        self._logged: set[int] = set()  # rows whose skip was logged
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self.rows)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.cfg.shuffle:
            random.Random(self.seed * 100003 + epoch).shuffle(order)
        return order

    def next(self) -> Prompt:
        """The next prompt, skipping over-long ones; cycles through epochs forever."""
        # The rest of this epoch plus one whole (reshuffled) next epoch visits every row.
        for _ in range(2 * len(self.rows)):
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            row = self._order[self.position]
            self.position += 1
            prompt = self.encode(row)
            if len(prompt.prompt_ids) <= self.limit:
                self.drawn += 1
                return prompt
            self._skip(row, len(prompt.prompt_ids))
        raise ValueError(f"every prompt is longer than the run's limit of {self.limit} tokens")

    def _skip(self, row: int, tokens: int) -> None:
        self.skipped_too_long += 1
        self._unreported += 1
        if row not in self._logged:
            self._logged.add(row)
            log.warning("prompt_too_long", row=row, tokens=tokens, limit=self.limit, skipped=self.skipped_too_long)

    def take_skipped(self) -> int:
        """Prompts skipped as too long since the last call."""
        n, self._unreported = self._unreported, 0
        return n

    def encode(self, row: int) -> Prompt:
        rec = self.rows[row]
        raw = rec.get(self.cfg.prompt_key, "")
        ids, text, messages = self._tokenize(raw)
        meta = {k: v for k, v in rec.items() if k not in (self.cfg.prompt_key, self.cfg.answer_key)}
        if not self.cfg.render_prompt:  # the rollout's agent renders the prompt (docs/ecosystem.md)
            meta["prompt"] = messages
        return Prompt(
            uid=self.drawn,
            row=row,
            prompt_ids=ids,
            text=text,
            answer=rec.get(self.cfg.answer_key),
            metadata=meta,
            messages=messages,
        )

    def _tokenize(self, raw: Any) -> tuple[list[int], str, list[dict[str, Any]]]:
        return encode(raw, self.tokenizer, self.cfg)

    def state(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "drawn": self.drawn,
            "skipped_too_long": self.skipped_too_long,
        }

    def restore(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self.drawn, self.skipped_too_long = state["drawn"], state.get("skipped_too_long", 0)
        self._order = self._epoch_order(self.epoch)

    def redo(self, row: int, uid: int) -> Prompt:
        """Re-encode a prompt drawn earlier (used to re-dispatch in-flight prompts on resume)."""
        prompt = self.encode(row)
        prompt.uid = uid
        return prompt
