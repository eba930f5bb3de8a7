"""The rollout engine's contract on a GPU: tests/integration/test_rollout_engine.py's tests,
run against the in-process engine (roles/generation/inproc.py) on GPU 0 with CUDA graphs and
vLLM's asynchronous scheduling, which vLLM-CPU turns off — so only here does an update pause
with a batch still queued, and the exact-token version test proves that batch is counted as
the old weights'. Also on the GPU: abort returns tokens so far, a bad request fails alone,
an in-place update equals a fresh engine on the new weights (run last: two in-process engines
share vLLM's process-wide distributed state, so the fresh one's shutdown ends the module's).

    VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m pytest -m gpu tests/gpu/test_rollout_engine_gpu.py -s -o addopts=""
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from roles.generation.engine import RolloutEngine
from runtime.config import EngineConfig
from tests.integration import test_rollout_engine as contract

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]
GPU_ENGINE = EngineConfig(max_model_len=256, max_num_seqs=64, gpu_memory_utilization=0.15, enforce_eager=False)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, loop: asyncio.AbstractEventLoop) -> Iterator[RolloutEngine]:
    contract.ENGINE = GPU_ENGINE  # the contract's second (fresh) engine runs on the GPU too
    eng = RolloutEngine(GPU_ENGINE, str(tiny_model_dir))
    loop.run_until_complete(eng.start())
    assert eng.engine is not None
    scheduler = loop.run_until_complete(eng.engine.call(lambda llm: llm.vllm_config.scheduler_config))
    print(f"\nasync scheduling: {scheduler.async_scheduling}")
    yield eng
    loop.run_until_complete(eng.shutdown())


test_generation_counts_and_lengths = contract.test_generation_counts_and_lengths
test_in_flight_update_switches_versions = contract.test_in_flight_update_switches_versions
test_every_token_carries_the_version_of_the_weights_that_sampled_it = (
    contract.test_every_token_carries_the_version_of_the_weights_that_sampled_it
)
test_older_update_is_refused = contract.test_older_update_is_refused
test_errors_are_per_request = contract.test_errors_are_per_request
test_abort_all_returns_tokens_so_far = contract.test_abort_all_returns_tokens_so_far
# Last: its fresh engine shares this process's distributed state with the module's (vLLM's
# engines here run in-process), and shutting it down tears that state down for both.
test_in_place_update_equals_fresh_engine = contract.test_in_place_update_equals_fresh_engine
