"""LoRA's frozen base on ONE GPU (one NCCL rank):

    python3 -m pytest -m gpu tests/gpu/test_lora_base_gpu.py -s -o addopts=""

Under bfloat16 mixed precision the FSDP2 actor stores the frozen base in bfloat16 and only the
adapters in float32 (roles/training/peft_lora.py `store_frozen_in`): the base holds half the GPU
memory of a float32 one, and three steps equal those of the same actor with a float32 base
(FSDP2 casts the base to bfloat16 before every forward either way).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from roles.trainer.fsdp_engine import FSDPEngine
from runtime.memory.auto import load_settled
from runtime.tiny.model import make_tiny_model
from tests.helpers.one_rank import ONE_GPU_ENGINE, full_params, one_rank_cuda_world, toy_batch

pytestmark = pytest.mark.gpu
LORA_MIXED = [*ONE_GPU_ENGINE, "trainer.lora.rank=8", "trainer.lora.alpha=16", "trainer.optim.lr=0.01",
              "fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: float32}"]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _one_rank_world() -> None:
    one_rank_cuda_world()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("lora_base") / "m", hidden_size=512, num_layers=4,
                           intermediate_size=1024, num_heads=8, num_kv_heads=2)  # fmt: skip


def _built(model_dir: Path) -> tuple[FSDPEngine, int]:
    """An engine and the GPU memory its construction left allocated (parameters and buffers)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = FSDPEngine(load_settled(None, LORA_MIXED), model_dir)
    torch.cuda.synchronize()
    return engine, torch.cuda.memory_allocated() - before


def test_the_base_is_stored_in_bfloat16_and_trains_like_a_float32_one(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stored, held_bf16 = _built(model_dir)
    params = dict(stored.model.named_parameters())
    adapters = {n for n, p in params.items() if p.requires_grad}
    assert adapters and all(params[n].dtype == torch.float32 for n in adapters)
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cuda" for n, p in params.items() if n not in adapters)

    monkeypatch.setattr("roles.trainer.fsdp_engine.store_frozen_in", lambda model, dtype: None)
    fp32_base, held_fp32 = _built(model_dir)
    frozen = sum(p.numel() for n, p in fp32_base.model.named_parameters() if not p.requires_grad)
    print(f"allocated after build: bfloat16 base {held_bf16 / 1e6:.1f} MB, float32 base {held_fp32 / 1e6:.1f} MB")
    assert held_fp32 - held_bf16 == pytest.approx(2 * frozen, rel=0.1)

    for seed in range(3):
        got, want = stored.train_step(toy_batch(seed)), fp32_base.train_step(toy_batch(seed))
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), seed
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-3), seed
    after, expected = full_params(stored), full_params(fp32_base)
    for name in adapters:
        torch.testing.assert_close(after[name], expected[name], rtol=1e-3, atol=1e-5, msg=name)
