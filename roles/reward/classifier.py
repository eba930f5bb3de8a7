"""A sequence-classification reward model: (prompt, response) text in, one scalar out.

A caller may rely on:
* `RewardClassifier.load()` reads an HF `AutoModelForSequenceClassification` directory
  with one label (`num_labels=1`; other heads are refused with a one-line error) and its
  tokenizer; `score(items)` returns one `(value, error)` per item, in order: the label's
  logit and "", or 0.0 and why there is none.
* A sample's text is the tokenizer's chat template over the prompt's messages (as the
  dataset gave them, before the policy's template) and the response as the assistant's
  turn, when the tokenizer has a template; else the prompt text followed by the response.
  Texts over `max_length` tokens lose their start (the response is kept).
* Forward passes run `batch_size` samples at a time in one worker thread, never on the
  event loop. A request whose scoring takes over `timeout_s` (excluding its wait for the
  one before it) answers at once with every item failed; the pass in progress finishes in
  the background and the next request waits for it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from runtime.config import RewardModelConfig
from runtime.errors import one_line
from transport import wire


def sample_text(tokenizer: Any, item: wire.RewardItem) -> tuple[str, bool]:
    """The text the model scores for `item`, and whether a chat template made it."""
    if getattr(tokenizer, "chat_template", None):
        messages = list(item.messages) or [{"role": "user", "content": item.prompt}]
        turn = {"role": "assistant", "content": item.completion}
        return tokenizer.apply_chat_template([*messages, turn], tokenize=False), True
    return item.prompt + item.completion, False


class RewardClassifier:
    def __init__(self, path: str, cfg: RewardModelConfig, device: str) -> None:
        self.path = path
        self.cfg = cfg
        self.device = device
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-model")
        self._lock = asyncio.Lock()
        self._running: asyncio.Future[list[float]] | None = None
        self.model: Any = None
        self.tokenizer: Any = None

    def load(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.path)
        tok.truncation_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(self.path, dtype=getattr(torch, self.cfg.dtype))
        if model.config.num_labels != 1:
            raise ValueError(
                f"reward.model.path '{self.path}': a reward model has one label (num_labels=1), "
                f"this one has {model.config.num_labels}"
            )
        model.config.pad_token_id = tok.pad_token_id  # where each row's last token is found
        self.model, self.tokenizer = model.to(self.device).eval(), tok

    async def score(self, items: list[wire.RewardItem]) -> list[tuple[float, str]]:
        if not items:
            return []
        loop = asyncio.get_running_loop()
        async with self._lock:
            if self._running is not None:
                await asyncio.wait([self._running])  # a pass that overran its request's bound
            self._running = loop.run_in_executor(self._pool, self.forward, items)
            try:
                values = await asyncio.wait_for(asyncio.shield(self._running), self.cfg.timeout_s)
            except TimeoutError:
                return [(0.0, f"reward model timed out after {self.cfg.timeout_s:g}s")] * len(items)
            except Exception as exc:  # a failed forward fails its request, never the role
                return [(0.0, f"reward model {one_line(exc)}"[:500])] * len(items)
        return [(v, "") for v in values]

    def forward(self, items: list[wire.RewardItem]) -> list[float]:
        """The model's score of every item (blocking; batches of `batch_size`)."""
        import torch

        out: list[float] = []
        for start in range(0, len(items), self.cfg.batch_size):
            texts = [sample_text(self.tokenizer, it) for it in items[start : start + self.cfg.batch_size]]
            enc = self.tokenizer(
                [t for t, _ in texts],
                truncation=True,
                max_length=self.cfg.max_length,
                padding=True,
                return_tensors="pt",
                add_special_tokens=not texts[0][1],
            ).to(self.device)
            with torch.inference_mode():
                logits_BL = self.model(**enc).logits
            out.extend(float(x) for x in logits_BL[:, 0].float().cpu())
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
