"""A generative judge: an LLM on its own vLLM engine reads a filled prompt template and
its output is parsed into a score.

A caller may rely on:
* `fill(template, item)` puts the sample's user prompt (the last user message before the
  policy's chat template, else the prompt text), its response and its reference answer
  ("" when none) into the template's `{prompt}`, `{response}` and `{answer}`.
* `parse_score(text)` (the default `reward.judge.parser`) returns the number after a
  `score` / `rating` / `grade` label, else the first number in the text, else 1.0 for a
  `yes` and 0.0 for a `no` (the first of those words); raises ValueError when there is
  none of these. A user parser has the same contract: text in, float out, ValueError (or
  any exception) when the text holds no score.
* `Judge.score(items)` returns one `(value, error)` per item, in order: the parsed score
  and "", or 0.0 and why there is none (generation failed or took over
  `reward.judge.timeout_s`, or the parser found no score). Failures are counted in
  `failures` by kind (`generation`, `parse`) and the first few of each are logged.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

from roles.generation.engine import RolloutEngine
from runtime.config import JudgeConfig
from runtime.errors import one_line
from runtime.logs import get_logger
from runtime.user_functions import load_function
from transport import wire

log = get_logger("reward_model")
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)"
_LABELLED = re.compile(r"\b(?:score|rating|grade)\b\s*(?:is|of)?\s*[:=]?\s*(" + _NUMBER + ")", re.IGNORECASE)
_ANY_NUMBER = re.compile(r"(?<![\w.])(" + _NUMBER + ")")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def parse_score(text: str) -> float:
    """The judge's score in `text`: a labelled number, else the first number, else yes/no."""
    for pattern in (_LABELLED, _ANY_NUMBER):
        m = pattern.search(text)
        if m is not None:
            return float(m.group(1))
    m = _YES_NO.search(text)
    if m is not None:
        return 1.0 if m.group(1).lower() == "yes" else 0.0
    raise ValueError(f"no number or yes/no in the judge's output {text[:120]!r}")


def user_prompt(item: wire.RewardItem) -> str:
    """The sample's prompt as the user wrote it (before the policy's chat template)."""
    users = [m for m in item.messages if m.get("role") == "user"]
    return str(users[-1].get("content", "")) if users else item.prompt


def fill(template: str, item: wire.RewardItem) -> str:
    answer = "" if item.answer is None else str(item.answer)
    return template.format(prompt=user_prompt(item), response=item.completion, answer=answer)


class Judge:
    def __init__(self, cfg: JudgeConfig) -> None:
        self.cfg = cfg
        self.parser: Callable[[str], Any] = load_function(cfg.parser, what="reward.judge.parser")
        self.engine = RolloutEngine(cfg.engine, cfg.model, prefix_salt=False)
        self.tokenizer: Any = None
        self.spec: wire.SamplingSpec | None = None
        self.failures: Counter[str] = Counter()

    async def start(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model)
        eos = self.tokenizer.eos_token_id
        c = self.cfg
        self.spec = wire.SamplingSpec(
            temperature=c.temperature,
            top_p=c.top_p,
            max_tokens=c.max_tokens,
            stop_token_ids=[] if eos is None else [eos],
        )
        await self.engine.start()

    def prompt_ids(self, item: wire.RewardItem) -> list[int]:
        text = fill(self.cfg.template, item)
        if self.cfg.chat_template and getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": text}]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(text)["input_ids"])

    async def score(self, items: list[wire.RewardItem]) -> list[tuple[float, str]]:
        request = uuid.uuid4().hex[:12]
        return list(await asyncio.gather(*[self._one(f"{request}-{i}", it) for i, it in enumerate(items)]))

    async def judge_text(self, request_id: str, item: wire.RewardItem) -> tuple[str, str]:
        """The judge's output for `item`, and the generation's error ("" when none)."""
        assert self.spec is not None, "start() first"
        sample = await self.engine.generate(request_id, self.prompt_ids(item), self.spec, timeout_s=self.cfg.timeout_s)
        if sample.error:
            return "", sample.error
        return self.tokenizer.decode(sample.token_ids, skip_special_tokens=True), ""

    async def _one(self, request_id: str, item: wire.RewardItem) -> tuple[float, str]:
        text, error = await self.judge_text(request_id, item)
        if error:
            return self._failed("generation", f"judge generation failed: {error}")
        try:
            value = self.parser(text)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{self.cfg.parser} returned {type(value).__name__}, not a number")
            return float(value), ""
        except Exception as exc:  # a parser's failure is the sample's missing score
            return self._failed("parse", f"judge output not parsed by {self.cfg.parser}: {one_line(exc)}")

    def _failed(self, kind: str, error: str) -> tuple[float, str]:
        self.failures[kind] += 1
        n = self.failures[kind]
        if n <= 3 or n % 100 == 0:
            log.warning("judge_failed", kind=kind, error=error[:500], failures=n)
        return 0.0, error[:500]

    async def close(self) -> None:
        await self.engine.shutdown()
