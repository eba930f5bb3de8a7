"""`trainer.lora` settings: what vLLM is started with, and the start-up refusals (one line each)."""

from __future__ import annotations

import pytest

from runtime.config.load import load_config
from runtime.config.lora_settings import adapter_config, engine_lora_rank, engine_max_loras
from runtime.errors import ConfigError
from runtime.preflight.environment import check_launch


@pytest.mark.parametrize(
    ("overrides", "rank", "loras"),
    [
        (["trainer.lora.rank=4"], 8, 3),  # the smallest vLLM size that holds it; staleness 1 + 2
        (["trainer.lora.rank=16", "rollout.max_staleness=0"], 16, 2),
        (["trainer.lora.rank=20", "rollout.engine.max_lora_rank=64", "rollout.engine.max_loras=5"], 64, 5),
        ([], 0, 3),
    ],
)
def test_vllm_gets_a_rank_it_offers_and_a_slot_per_version_in_flight(
    overrides: list[str], rank: int, loras: int
) -> None:
    cfg = load_config("configs/tiny_cpu.yaml", overrides)
    check_launch(cfg)
    assert (engine_lora_rank(cfg), engine_max_loras(cfg)) == (rank, loras)


def test_the_adapter_config_is_what_peft_reads() -> None:
    from peft import LoraConfig

    cfg = load_config("configs/tiny_cpu.yaml", ["trainer.lora.rank=8", "trainer.lora.alpha=32"])
    fields = adapter_config(cfg.trainer.lora)
    peft = LoraConfig(**{k: v for k, v in fields.items() if k != "peft_type"})
    assert (peft.r, peft.lora_alpha, set(peft.target_modules)) == (8, 32, set(cfg.trainer.lora.target_modules))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.lora.rank=8", "trainer.backend=megatron", "fsdp.use_fsdp=false", "trainer.device=cuda"],
         "trainer.lora needs trainer.backend=fsdp"),
        (["trainer.lora.rank=32", "rollout.engine.max_lora_rank=16"], "trainer.lora.rank=32 exceeds"),
        (["trainer.lora.rank=600"], "exceeds rollout.engine.max_lora_rank=512"),
        (["rollout.engine.max_lora_rank=12"], "max_lora_rank=12 is not one of vLLM's"),
        (["trainer.lora.rank=8", "trainer.lora.target_modules=[]"], "trainer.lora.target_modules is empty"),
        (["trainer.lora.rank=8", "trainer.device=cuda", "rollout.max_staleness=0",
          "rollout.engine.sleep_when_idle=true", "placement=[{role: controller}, {role: reward},"
          " {role: rollout, devices: [0]}, {role: trainer, devices: [0]}]"],
         "rollout.engine.sleep_when_idle=true with trainer.lora: vLLM's wake-up"),
    ],
)  # fmt: skip
def test_bad_lora_settings_are_refused_in_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        check_launch(load_config("configs/tiny_cpu.yaml", overrides))
    assert "\n" not in str(err.value)
