"""Which one-rank runs reduce every micro-batch's gradients (roles/fsdp/wrap.py)."""

from __future__ import annotations

from roles.fsdp.wrap import reduces_each_micro_batch
from runtime.config import FSDPConfig


def test_full_offload_reduces_every_micro_batch() -> None:
    # Under fsdp.cpu_offload the sharded gradients live in host memory: an unsharded float32
    # copy accumulated on the GPU would hold 4 bytes per parameter there (the memory plan counts none).
    assert reduces_each_micro_batch(FSDPConfig(cpu_offload=True))
    assert reduces_each_micro_batch(FSDPConfig(cpu_offload=True, one_rank_accumulation="unsharded"))
    assert reduces_each_micro_batch(FSDPConfig(one_rank_accumulation="reduced"))
    assert not reduces_each_micro_batch(FSDPConfig())
