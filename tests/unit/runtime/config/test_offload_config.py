"""`trainer.offload` is refused at config load, in one line, wherever it could not act."""

from __future__ import annotations

import pytest

from runtime.config.load import load_config
from runtime.errors import ConfigError
from runtime.preflight.environment import check_launch

BENCH = "configs/bench_1.5b.yaml"  # rollout and trainer colocated on GPU 0


def _check(*overrides: str, config: str | None = BENCH) -> None:
    check_launch(load_config(config, list(overrides)))


def test_optimizer_offload_is_accepted_for_the_fsdp2_actor() -> None:
    _check("trainer.offload.optimizer=true")
    _check("trainer.offload.optimizer=true", config=None)  # the CPU run: streamed through host memory
    _check("trainer.offload.params=true", "rollout.max_staleness=0")  # sync colocated: vLLM sleeps


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["trainer.offload.optimizer=true", "trainer.backend=megatron"], "trainer.offload is the FSDP2 actor's"),
        (["trainer.offload.optimizer=true", "fsdp.cpu_offload=true"], "FSDP2 already keeps"),
        (["trainer.offload.params=true"], "trainer.offload.params=true frees"),  # async: vLLM never sleeps
        (
            ["trainer.offload.params=true", "rollout.max_staleness=0", "rollout.engine.sleep_when_idle=false"],
            "trainer.offload.params=true frees",
        ),
    ],
)
def test_offload_where_it_cannot_act_is_refused_in_one_line(overrides: list[str], words: str) -> None:
    with pytest.raises(ConfigError) as info:
        _check(*overrides)
    assert words in str(info.value) and "\n" not in str(info.value)
