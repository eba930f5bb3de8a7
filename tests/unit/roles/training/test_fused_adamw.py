"""`trainer.optim.implementation=fused`: torch's fused AdamW steps the FSDP2 actor (DTensor
parameters, one gloo rank) to the same weights as the default step, and a combination
where it would do nothing or cannot act is refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.config.load import load_config
from runtime.errors import ConfigError
from runtime.preflight.environment import check_launch
from runtime.tiny.model import make_tiny_model
from tests.helpers.one_rank import full_params, one_rank_world, toy_batch, toy_engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    one_rank_world()
    return make_tiny_model(tmp_path_factory.mktemp("fused") / "m")


def _trained(model_dir: Path, *overrides: str) -> tuple[torch.optim.Optimizer, dict[str, torch.Tensor], bool]:
    """The optimizer, the weights after two steps, and whether every weight moved."""
    engine = toy_engine(model_dir, *overrides)
    start = full_params(engine)
    for seed in range(2):
        engine.train_step(toy_batch(seed))
    end = full_params(engine)
    return engine.optimizer, end, all(not torch.equal(start[n], end[n]) for n in start)


def test_fused_adamw_steps_to_the_default_steps_weights(model_dir: Path) -> None:
    default_opt, want, moved = _trained(model_dir)
    fused_opt, got, _ = _trained(model_dir, "trainer.optim.implementation=fused")
    assert fused_opt.defaults["fused"] is True and not default_opt.defaults.get("fused")
    assert moved  # the comparison below compares steps, not two untouched copies
    for name, tensor in got.items():
        # A step moves a weight by about lr (0.05); the two kernels' float32 orders differ by
        # ~1e-5 at most (an embedding row whose gradient is near eps), ~1e-8 on average.
        torch.testing.assert_close(tensor, want[name], rtol=1e-5, atol=1e-4, msg=name)


def test_fused_where_it_cannot_act_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^trainer.optim.implementation=fused cannot step an offloaded optimizer"):
        check_launch(load_config(None, ["trainer.optim.implementation=fused", "trainer.offload.optimizer=true"]))
    with pytest.raises(ConfigError, match=r"^trainer.optim.implementation=fused has no effect"):
        check_launch(load_config(None, ["trainer.optim.implementation=fused", "trainer.backend=megatron"]))
