"""Why a test is skipped on this machine's GPUs, if it is (tests/conftest.py applies it).

A `gpu` test needs an NVIDIA GPU; one marked `gpus(n)` needs at least `n` of them visible
(CUDA_VISIBLE_DEVICES counted), so a one-GPU machine skips the two-GPU tests with their
reason instead of failing them.
"""

from __future__ import annotations

import pytest


def wants_gpus(item: pytest.Item) -> bool:
    """Whether `item` is a GPU test (marked `gpu` or `gpus(n)`)."""
    return "gpu" in item.keywords or item.get_closest_marker("gpus") is not None


def gpu_skip_reason(item: pytest.Item, visible_gpus: int) -> str | None:
    """The skip reason for `item` on a machine with `visible_gpus` CUDA devices; None if it runs."""
    if not wants_gpus(item):
        return None
    if visible_gpus == 0:
        return "needs an NVIDIA GPU (marker gpu)"
    marker = item.get_closest_marker("gpus")
    if marker is None:
        return None
    needed = int(marker.args[0]) if marker.args else 1
    if visible_gpus < needed:
        have = "1 is" if visible_gpus == 1 else f"{visible_gpus} are"
        return f"needs {needed} NVIDIA GPUs (marker gpus({needed})); {have} visible"
    return None
