"""`trainer.compile` defaults to `auto` (roles/trainer/fsdp_engine.py `compiles`): the compiled
actor on CUDA (16 % faster steps and 14 GB less at 1.54B on the H200), eager on the CPU, with
LoRA adapters and with Liger's kernels (which dynamo cannot trace, so `auto` with Liger passes
the launch check that refuses an explicit `true`); an explicit value always wins. cuDNN's
varlen attention is refused on an H100, where it crashed, in one line."""

from __future__ import annotations

import pytest
import torch

from roles.kernels.varlen_cudnn import refuse_where_it_crashes
from roles.trainer.fsdp_engine import compiles
from runtime.config import TrainerConfig
from runtime.config.load import load_config
from runtime.preflight.environment import check_launch

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")
ONE_GPU = "placement=[{role: controller}, {role: rollout, devices: [0]}, {role: reward}, {role: trainer, devices: [0]}]"


def trainer(*overrides: str) -> TrainerConfig:
    return load_config(None, list(overrides)).trainer


def test_auto_is_the_default_and_compiles_the_full_actor_on_cuda_only() -> None:
    assert trainer().compile == "auto"
    assert compiles(trainer(), CUDA) is True
    assert compiles(trainer(), CPU) is False
    assert compiles(trainer("trainer.lora.rank=8"), CUDA) is False
    assert compiles(trainer("trainer.kernels=liger"), CUDA) is False


def test_an_explicit_value_wins() -> None:
    assert compiles(trainer("trainer.compile=false"), CUDA) is False
    assert compiles(trainer("trainer.compile=true"), CPU) is True
    assert compiles(trainer("trainer.compile=true", "trainer.lora.rank=8"), CUDA) is True


def test_liger_with_auto_passes_the_launch_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())  # liger-kernel "installed"
    check_launch(load_config(None, ["trainer.kernels=liger", "trainer.device=cuda", ONE_GPU]))


def test_cudnn_attention_is_refused_on_an_h100_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    with pytest.raises(RuntimeError, match=r"^trainer.attention_kernel=cudnn is refused on an H100: .*illegal memory"):
        refuse_where_it_crashes(CUDA)
    refuse_where_it_crashes(CPU)  # the CPU takes the plain varlen path: nothing to refuse
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    refuse_where_it_crashes(CUDA)
