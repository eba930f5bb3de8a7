"""The FSDP engines in the test process: a world of one gloo rank, and a toy batch.

`one_rank_world()` initialises torch.distributed once per process (a no-op after);
`full_params(engine)` copies an engine's parameters whole;
`toy_batch(seed)` is NUM_SEQS sequences of PROMPT prompt and RESPONSE response tokens with
advantages alternating -1 / +1 by sequence; `toy_engine(model, *overrides)` the FSDP2
actor engine on CPU in float32 with a large lr and no gradient clip (changes show at once).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from roles.trainer.fsdp_engine import FSDPEngine
from runtime.config.load import load_config
from tests.helpers.ports import world_of_one
from transport.wire import TrainBatch

PROMPT, RESPONSE, NUM_SEQS = 4, 6, 8
# The FSDP2 actor on GPU 0 of a one-GPU placement (synchronous, no gradient clip).
ONE_GPU_ENGINE = ["trainer.device=cuda", "trainer.optim.lr=0.001", "trainer.optim.grad_clip=0",
                  "rollout.max_staleness=0", "placement=[{role: controller}, {role: rollout, devices: [0]}, "
                  "{role: reward}, {role: trainer, devices: [0]}]"]  # fmt: skip


def one_rank_world() -> None:
    if not dist.is_initialized():
        world_of_one("gloo")


def one_rank_cuda_world() -> None:
    """A world of one NCCL rank on GPU 0 (a no-op without CUDA or once initialised)."""
    if torch.cuda.is_available() and not dist.is_initialized():
        torch.cuda.set_device(0)
        world_of_one("nccl", device_id=torch.device("cuda", 0))


def toy_engine(model: Path, *overrides: str) -> FSDPEngine:
    base = ["trainer.device=cpu", "fsdp.param_dtype=float32", "trainer.optim.lr=0.05", "trainer.optim.grad_clip=0"]
    return FSDPEngine(load_config(None, [*base, *overrides]), model)


def full_params(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    """Every parameter of `engine.model`, gathered whole (DTensor `full_tensor`) and copied."""
    return {n: p.detach().full_tensor().clone() for n, p in engine.model.named_parameters()}


def toy_batch(seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    n = PROMPT + RESPONSE
    ids = torch.randint(3, 200, (NUM_SEQS * n,), generator=g)
    mask = torch.cat([torch.cat([torch.zeros(PROMPT), torch.ones(RESPONSE)])] * NUM_SEQS)
    adv = (torch.arange(NUM_SEQS) % 2 * 2.0 - 1.0).repeat_interleave(n) * mask
    return TrainBatch(
        step=0, input_ids=ids, cu_seqlens=torch.arange(0, NUM_SEQS * n + 1, n), loss_mask=mask,
        behaviour_logprobs=torch.zeros(NUM_SEQS * n), advantages=adv, global_num_tokens=NUM_SEQS * RESPONSE,
        global_num_seqs=NUM_SEQS,
    )  # fmt: skip
