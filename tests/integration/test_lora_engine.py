"""LoRA on the real FSDP2 actor engine (one gloo rank, the tiny Qwen2, PEFT adapters).

Only the adapters train (the base's weights stay bit for bit), an update exports only the
adapters under PEFT's names, the KL reference is the base (the adapter disabled), the
checkpoint round-trips the adapters and their optimizer state, and `tandem export --merge`
equals W + alpha/r * B @ A.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from roles.trainer.fsdp_engine import FSDPEngine
from roles.weights.lora_adapters import write_adapter_dir
from runtime.checkpoints.export import merge_adapter
from runtime.config.load import load_config
from runtime.config.lora_settings import adapter_config
from tests.helpers.lora import assert_merged
from tests.helpers.one_rank import full_params, one_rank_world, toy_batch, toy_engine

LORA = ("trainer.lora.rank=8", "trainer.lora.alpha=16")


@pytest.fixture(scope="module", autouse=True)
def _one_rank_world() -> None:
    one_rank_world()


def _engine(model: Path, *overrides: str) -> FSDPEngine:
    return toy_engine(model, *LORA, *overrides)


def test_only_the_adapters_train_and_only_they_are_exported(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    in_optimizer = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in engine.model.parameters() if p.requires_grad}
    before = full_params(engine)
    for seed in range(3):
        engine.train_step(toy_batch(seed))
    after = full_params(engine)
    base = [n for n in before if n not in trainable]
    assert base and all(torch.equal(before[n], after[n]) for n in base), "a base weight changed"
    lora_b = [n for n in trainable if ".lora_B." in n]
    assert all(not torch.equal(before[n], after[n]) for n in lora_b), "an adapter did not train"
    assert all(float(before[n].abs().sum()) == 0.0 for n in lora_b)  # PEFT starts B at zero: v0 is the base

    exported = dict(engine.export_weights(torch.bfloat16))
    assert len(exported) == len(trainable)
    assert all(n.startswith("base_model.model.") and ".default." not in n for n in exported)
    assert sum(t.numel() * 2 for t in exported.values()) == sum(after[n].numel() * 2 for n in trainable)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert torch.equal(exported[name], after[name.replace("lora_B.", "lora_B.default.")].to(torch.bfloat16))


def test_the_kl_reference_is_the_base_model(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, "algorithm.kl.enabled=true", "algorithm.kl.use=loss", "algorithm.kl.coef=0.1")
    assert engine.ref_model is None  # no second copy of the weights
    first = engine.train_step(toy_batch(0))
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-7)  # version 0 is the base exactly
    engine.train_step(toy_batch(1))
    later = engine.train_step(toy_batch(2))
    assert later["kl_ref"] > 1e-4, later


def test_checkpoint_holds_the_adapters_and_their_optimizer_state(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = _engine(tiny_model_dir)
    engine.train_step(toy_batch(0))
    engine.save(tmp_path / "ckpt")
    expected = full_params(engine)
    saved = sum(f.stat().st_size for f in (tmp_path / "ckpt").glob("*.distcp"))
    full = sum(p.numel() * 4 for p in expected.values())
    assert saved < 0.5 * full, (saved, full)  # the frozen base is not in it
    after_one = engine.train_step(toy_batch(1))

    resumed = _engine(tiny_model_dir)
    resumed.load(tmp_path / "ckpt")
    got = full_params(resumed)
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    assert resumed.version == 1
    again = resumed.train_step(toy_batch(1))
    assert again["loss"] == pytest.approx(after_one["loss"], rel=1e-6)
    assert again["grad_norm"] == pytest.approx(after_one["grad_norm"], rel=1e-5)


def test_merged_export_equals_base_plus_scaled_b_a(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = _engine(tiny_model_dir)
    for seed in range(2):
        engine.train_step(toy_batch(seed))
    tensors = dict(engine.export_weights(torch.float32))
    cfg = load_config(None, list(LORA))
    adapter = write_adapter_dir(tensors, adapter_config(cfg.trainer.lora), tmp_path / "adapter")
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 8
    merged = load_file(str(merge_adapter(adapter, tiny_model_dir, tmp_path / "merged") / "model.safetensors"))
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    checked = assert_merged(base, tensors, merged, 16 / 8)
    assert checked == 7 * 2  # q, k, v, o, gate, up, down in both layers


MIXED = "fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: float32}"


def test_under_mixed_precision_the_base_is_stored_in_the_compute_dtype_and_trains_the_same(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stored = _engine(tiny_model_dir, MIXED)
    dtypes = {n: p.dtype for n, p in stored.model.named_parameters()}
    adapters = {n for n, p in stored.model.named_parameters() if p.requires_grad}
    assert adapters and all(dtypes[n] == torch.float32 for n in adapters)  # the optimizer's masters
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if n not in adapters)

    # The same engine with its base left in float32: FSDP2 casts it to bfloat16 before every
    # forward, so each step must give the same loss, gradient and adapters.
    monkeypatch.setattr("roles.trainer.fsdp_engine.store_frozen_in", lambda model, dtype: None)
    fp32_base = _engine(tiny_model_dir, MIXED)
    assert all(p.dtype == torch.float32 for p in fp32_base.model.parameters())
    for seed in range(3):
        got, want = stored.train_step(toy_batch(seed)), fp32_base.train_step(toy_batch(seed))
        assert got["loss"] == want["loss"], seed
        assert got["grad_norm"] == want["grad_norm"], seed
    after, expected = full_params(stored), full_params(fp32_base)
    assert all(torch.equal(after[n], expected[n]) for n in adapters)
