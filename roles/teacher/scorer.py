"""Teacher log-probabilities of given tokens on vLLM: each sample is one prompt
(its prompt ids, then its response ids) whose `prompt_logprobs` vLLM computes in one
prefill; one token is generated (vLLM always generates) and thrown away. The teacher never
samples a response.

What a caller may rely on:
* A sample of up to `max_model_len` tokens (prompt and response) is scored: the engine
  starts with one more, for the throw-away token.
* `TeacherScorer.score(items)` returns one `TeacherScore` per item, in order: the
  log-probability under the teacher of each response token given everything before it
  (`len(completion_ids)` floats, raw: no temperature, the full vocabulary), or an error
  and a reason (`refused`: vLLM refused the request, e.g. longer than the teacher's
  `max_model_len`; `timeout`: not done within the bound, then aborted).
* A dead vLLM engine raises `EngineDeadError` from `score`; the role then ends.
* The same token ids give the same log-probabilities (prefix caching is off for
  requests with prompt logprobs in vLLM; no state is kept between requests).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

from roles.generation.engine import engine_kwargs
from roles.generation.errors import EngineDeadError
from roles.generation.inproc import Finished, InprocEngine
from runtime.config import EngineConfig
from runtime.errors import one_line
from transport import wire


class _PromptLogprobEngine(InprocEngine):
    """The in-process engine whose finished requests carry the prompt's token logprobs
    (`Finished.logprobs`: one per prompt token after the first) instead of the sampled token's."""

    def _deliver(self, outputs: list[Any]) -> None:
        for out in outputs:
            ids = list(out.prompt_token_ids or [])
            entries = list(out.prompt_logprobs or [])[1:]  # the first prompt token has none
            logprobs = [float(entry[tok].logprob) for tok, entry in zip(ids[1:], entries, strict=False)]
            self._set(out.request_id, Finished(ids, logprobs, "stop"))


class TeacherScorer:
    def __init__(self, cfg: EngineConfig, model_path: str, *, timeout_s: float, max_batched_tokens: int = 0) -> None:
        """`max_batched_tokens`: vLLM's max_num_batched_tokens (0: vLLM's default), raised to
        `cfg.max_model_len + 1` when below: the full-vocabulary log-probabilities of that many
        prompt tokens are what scoring adds to the engine's memory."""
        self.max_batched_tokens = max_batched_tokens
        self.cfg = cfg
        self.model_path = model_path
        self.timeout_s = timeout_s
        self.engine: _PromptLogprobEngine | None = None
        self.tokens_scored = 0

    async def start(self) -> None:
        if not os.path.isdir(self.model_path):
            raise FileNotFoundError(f"algorithm.distill.teacher '{self.model_path}' is not a directory")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.cfg.cpu_kvcache_gb))
        kwargs = engine_kwargs(self.cfg, self.model_path)
        kwargs["enable_prefix_caching"] = False  # vLLM recomputes prompt logprobs anyway
        kwargs["max_model_len"] = self.cfg.max_model_len + 1  # room for the throw-away token of a full-length sample
        if self.max_batched_tokens:
            kwargs["max_num_batched_tokens"] = max(self.max_batched_tokens, kwargs["max_model_len"])
        engine = _PromptLogprobEngine(kwargs, name="teacher-engine")
        await engine.start()
        self.engine = engine

    async def score(self, items: list[wire.TeacherItem]) -> list[wire.TeacherScore]:
        """One score per item (module docstring)."""
        request = uuid.uuid4().hex[:12]
        return list(await asyncio.gather(*[self._one(f"{request}-{i}", it) for i, it in enumerate(items)]))

    async def _one(self, request_id: str, item: wire.TeacherItem) -> wire.TeacherScore:
        assert self.engine is not None, "start() first"
        n = len(item.completion_ids)
        if n == 0:
            return wire.TeacherScore(item.sample_id, [])
        ids = list(item.prompt_ids) + list(item.completion_ids)
        if len(item.prompt_ids) == 0:  # the first token has no context: nothing to condition on
            return wire.TeacherScore(item.sample_id, error="a sample without prompt tokens", reason="refused")
        done = self.engine.add_request(request_id, {"prompt_token_ids": ids}, _params())
        try:
            result = await asyncio.wait_for(done, self.timeout_s)
        except TimeoutError:
            await asyncio.wait_for(self.engine.abort(request_id), self.cfg.call_timeout_s)
            error = f"teacher took over algorithm.distill.timeout_s={self.timeout_s:g}s"
            return wire.TeacherScore(item.sample_id, error=error, reason="timeout")
        except EngineDeadError:
            raise
        except Exception as exc:  # vLLM refused this request alone (too long, bad ids)
            if self.engine.errored:
                raise EngineDeadError(f"vLLM engine died: {self.engine.dead_error}") from exc
            return wire.TeacherScore(item.sample_id, error=one_line(exc), reason="refused")
        self.tokens_scored += n
        return wire.TeacherScore(item.sample_id, result.logprobs[-n:])

    @property
    def errored(self) -> bool:
        return self.engine is not None and self.engine.errored

    def close(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.shutdown()


def _params() -> Any:
    """One throw-away token; the logprob of every prompt token (the token itself only)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=1,
        temperature=0.0,
        prompt_logprobs=0,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
