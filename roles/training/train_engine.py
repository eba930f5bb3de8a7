"""What the trainer and critic roles may call on an engine, whichever backend built it.

`TrainEngine` is the surface both backends' engines offer (the FSDP2 bases in
`roles/fsdp/engine_base.py`, the Megatron-core base in `roles/megatron/engine_base.py`):
one `train_step` per batch, sharded checkpoints, and parameters that may leave the device
between steps. `PolicyEngine` adds the actor's weight export, `ValueEngine` the critic's
value scoring. The roles are typed against these protocols, never against a backend's
class, so mypy checks that every engine offers what its role calls.

Every method is a blocking collective unless said otherwise: each rank calls it in the
same order, from the role's one torch thread (`roles/training/torch_role.py`).

Both backends' bases also ask the same of their subclasses (not part of the protocol: the
roles never call them): `forward(model, mb)`, the model's output for one micro-batch on
the device, and `loss(mb, batch, output)`, that micro-batch's loss and metrics from it;
`prepare(batch)` before several updates on one batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

from transport.wire import TrainBatch, ValueRequest


class TrainEngine(Protocol):
    """An engine that trains on the controller's batches; `version` counts trained batches."""

    version: int
    rank: int
    world_size: int
    device: torch.device

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """The optimizer step(s) on this rank's shard of one batch; the step's metrics,
        reduced over ranks. `version` counts one more batch afterwards."""
        ...

    def save(self, directory: Path) -> None:
        """This rank's part of the engine's state (weights, optimizer, counters, RNG) into `directory`."""
        ...

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote."""
        ...

    def offload_params(self) -> None:
        """Move the parameters to host memory until the next step needs them, where the
        engine can (a no-op otherwise). Not a collective."""
        ...


class PolicyEngine(TrainEngine, Protocol):
    """The actor's engine: its weights go to the rollouts after every step."""

    def export_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors by HF name (PEFT names with LoRA) in `dtype`. A collective: every
        rank iterates it to the end."""
        ...


class ValueEngine(TrainEngine, Protocol):
    """The critic's engine: it scores sequences as well as training on them."""

    def values(self, req: ValueRequest) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token values of this rank's packed sequences of `req` (position j: V(state
        before token j)) and, when the critic holds the reference policy, its token logprobs."""
        ...
