"""The RNG state a training checkpoint carries: torch (CPU and, if present, CUDA), python
and numpy. `set_rng_state(rng_state())` restores every generator exactly; a CUDA state
saved on a GPU machine is skipped where there is no GPU."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore `state`; its tensors may have been loaded onto any device (the generators
    take CPU ByteTensors only)."""
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
