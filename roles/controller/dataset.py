"""Prompt datasets: JSONL / Parquet files or the synthetic copy task, with a resumable cursor.

`PromptDataset.next()` returns prompts in a seeded order (reshuffled each epoch when
`data.shuffle`); `state()` / `restore()` capture the cursor exactly, so a resumed run
continues with the next prompt that was not yet drawn. Prompts longer than
`data.max_prompt_tokens` are skipped and counted in `skipped_too_long`.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field
from typing import Any

from runtime.config import DataConfig
from runtime.data_files import read_rows


@dataclass
class Prompt:
    uid: int  # position in the stream of drawn prompts (stable across resume)
    row: int  # row of the dataset
    prompt_ids: list[int]
    text: str
    answer: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)  # the prompt as chat messages, before any template


def synthetic_rows(cfg: DataConfig, seed: int) -> list[dict[str, Any]]:
    """The copy task: prompts of random distinct lowercase letters; see reward builtin copy_task."""
    rng = random.Random(seed)
    rows = []
    for _ in range(cfg.synthetic_num_prompts):
        letters = "".join(rng.sample(string.ascii_lowercase, cfg.synthetic_prompt_len))
        rows.append({"prompt": letters, "answer": letters, "task": "copy"})
    return rows


class PromptDataset:
    def __init__(self, cfg: DataConfig, tokenizer: Any, seed: int = 0) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.seed = seed
        self.rows = synthetic_rows(cfg, seed) if cfg.source == "synthetic" else read_rows(cfg.path, cfg.prompt_key)
        if not self.rows:
            raise ValueError("the synthetic dataset is empty (data.synthetic_num_prompts)")
        self.epoch = 0
        self.position = 0
        self.drawn = 0
        self.skipped_too_long = 0
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
            if len(prompt.prompt_ids) <= self.cfg.max_prompt_tokens:
                self.drawn += 1
                return prompt
            self.skipped_too_long += 1
        raise ValueError(f"every prompt is longer than data.max_prompt_tokens={self.cfg.max_prompt_tokens}")

    def encode(self, row: int) -> Prompt:
        rec = self.rows[row]
        raw = rec.get(self.cfg.prompt_key, "")
        ids, text, messages = self._tokenize(raw)
        meta = {k: v for k, v in rec.items() if k not in (self.cfg.prompt_key, self.cfg.answer_key)}
        return Prompt(
            uid=self.drawn, row=row, prompt_ids=ids, text=text, answer=rec.get(self.cfg.answer_key), metadata=meta,
            messages=messages,
        )  # fmt: skip

    def _tokenize(self, raw: Any) -> tuple[list[int], str, list[dict[str, Any]]]:
        tok = self.tokenizer
        messages = raw if isinstance(raw, list) else [{"role": "user", "content": str(raw)}]
        if self.cfg.chat_template and getattr(tok, "chat_template", None):
            if self.cfg.system_prompt and messages[0].get("role") != "system":
                messages = [{"role": "system", "content": self.cfg.system_prompt}, *messages]
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:
            text = "\n".join(str(m.get("content", "")) for m in messages)
        return list(tok(text, add_special_tokens=False)["input_ids"]), text, messages

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
