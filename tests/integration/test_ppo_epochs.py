"""PPO epochs and mini-batches on the real FSDP2 actor engine (one gloo rank, tiny Qwen2).

epochs = mini-batches = 1 is today's update (no proximal forward, ratio 1, no clipping);
more steps take their ratio against one no-grad forward before the first update, so
the clip acts; every configuration publishes exactly one policy version per batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from roles.trainer.fsdp_engine import FSDPEngine
from roles.training.minibatch import select_sequences, shuffled_splits
from tests.helpers.one_rank import NUM_SEQS, PROMPT, RESPONSE, one_rank_world, toy_batch, toy_engine
from transport.wire import TrainBatch


@pytest.fixture(scope="module", autouse=True)
def _one_rank_world() -> None:
    one_rank_world()


def _on_policy(engine: FSDPEngine, batch: TrainBatch) -> TrainBatch:
    """`batch` with behaviour logprobs equal to the engine's own (importance weight 1)."""
    prox = engine.prepare(batch).proximal_logprobs
    assert prox is not None
    batch.behaviour_logprobs = prox * batch.loss_mask
    return batch


def _record_grads(engine: FSDPEngine) -> list[dict[str, torch.Tensor]]:
    """Full gradients at each optimizer step of `engine`, from now on."""
    seen: list[dict[str, torch.Tensor]] = []
    step = engine.optimizer_step

    def recording(*args: Any, **kwargs: Any) -> dict[str, float]:
        grads = {n: p.grad.full_tensor().clone() for n, p in engine.model.named_parameters() if p.grad is not None}
        seen.append(grads)
        return step(*args, **kwargs)

    engine.optimizer_step = recording  # type: ignore[method-assign]
    return seen


def test_select_and_split_cover_every_sequence_once() -> None:
    batch = toy_batch()
    parts = shuffled_splits(NUM_SEQS, 3, torch.Generator().manual_seed(1))
    assert sorted(i for p in parts for i in p) == list(range(NUM_SEQS))
    assert [len(p) for p in parts] == [3, 3, 2]
    sub = select_sequences(batch, [5, 2])
    n = PROMPT + RESPONSE
    assert sub.cu_seqlens.tolist() == [0, n, 2 * n]
    assert torch.equal(sub.input_ids, torch.cat([batch.input_ids[5 * n : 6 * n], batch.input_ids[2 * n : 3 * n]]))
    assert torch.equal(sub.advantages[:n], batch.advantages[5 * n : 6 * n])


def test_one_epoch_one_mini_batch_is_todays_update(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No proximal forward, ratio 1, one step; the same gradient as the many-step path
    forced through one step with the no-grad forward's logprobs. (Gradients, not weights:
    Adam's first step is about lr * sign(g), so summation-order noise on a zero gradient
    would flip whole entries.)"""
    fast = toy_engine(tiny_model_dir)
    batch = _on_policy(fast, toy_batch())
    monkeypatch.setattr(fast, "prepare", lambda b: pytest.fail("epochs=mini_batches=1 ran a proximal forward"))
    fast_grads = _record_grads(fast)
    m = fast.train_step(batch)
    assert m["clip_fraction"] == 0.0 and m["ratio_max"] == pytest.approx(1.0)
    assert m["optimizer_steps"] == 1.0 and fast.version == 1
    forced = toy_engine(tiny_model_dir)
    forced_grads = _record_grads(forced)
    forced.model.train()
    forced_m, _ = forced._ppo_updates(forced.prepare(batch))
    assert forced_m["loss"] == pytest.approx(m["loss"], abs=1e-6)
    assert len(fast_grads) == len(forced_grads) == 1
    for name, g in fast_grads[0].items():
        torch.testing.assert_close(g, forced_grads[0][name], atol=1e-6, rtol=1e-4, msg=name)


def test_two_epochs_clip_and_publish_one_version(tiny_model_dir: Path) -> None:
    engine = toy_engine(tiny_model_dir, "trainer.ppo_epochs=2")
    m = engine.train_step(_on_policy(engine, toy_batch()))
    assert m["optimizer_steps"] == 2.0 and engine.version == 1
    assert m["clip_fraction"] > 0.0  # the second epoch's ratio left [0.8, 1.2]
    assert m["ratio_max"] > 1.0


def test_epochs_times_mini_batches_optimizer_steps(tiny_model_dir: Path) -> None:
    engine = toy_engine(tiny_model_dir, "trainer.ppo_epochs=2", "trainer.mini_batches=3")
    m = engine.train_step(_on_policy(engine, toy_batch()))
    assert m["optimizer_steps"] == 6.0 and engine.version == 1
    assert engine.scheduler.last_epoch == 6
    assert m["micro_batches"] >= 6
