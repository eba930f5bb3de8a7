"""`trainer.kernels` (roles/kernels/block_kernels.py): `torch` leaves the model as it is; `liger`
is refused at launch, one line naming the field, without CUDA, on Megatron or without the
package; and a Liger that leaves any RMSNorm or MLP of the model untouched is an error
naming the module, not a silent run on transformers' own kernels. Liger's kernels
themselves need a GPU: tests/gpu/test_liger_gpu.py runs them."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from roles.kernels import block_kernels
from roles.training.hf_loading import load_causal_lm
from runtime.config.load import load_config
from runtime.errors import ConfigError
from runtime.preflight.environment import check_launch

ONE_GPU = "placement=[{role: controller}, {role: rollout, devices: [0]}, {role: reward}, {role: trainer, devices: [0]}]"


def _model(path: Path):
    import torch

    return load_causal_lm(path, torch.float32, torch.device("cpu"))


def test_torch_kernels_change_nothing(tiny_model_dir: Path) -> None:
    model = _model(tiny_model_dir)
    before = [(name, type(m), m._get_name()) for name, m in model.named_modules()]
    block_kernels.apply_kernels(model, "torch")
    assert [(name, type(m), m._get_name()) for name, m in model.named_modules()] == before


def test_liger_without_the_package_names_it(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_kernels, "liger_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"^trainer.kernels=liger needs the liger-kernel package"):
        block_kernels.apply_kernels(_model(tiny_model_dir), "liger")
    with pytest.raises(ValueError, match=r"^trainer\.kernels must be one of"):
        block_kernels.apply_kernels(_model(tiny_model_dir), "apex")


def test_a_liger_that_patches_nothing_is_an_error(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Liger without kernels for the model's type logs a warning and returns: the engine
    must not then run transformers' kernels under a `liger` label."""
    fake = types.ModuleType("liger_kernel.transformers")
    fake._apply_liger_kernel_to_instance = lambda **kw: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    monkeypatch.setattr(block_kernels, "liger_available", lambda: True)
    with pytest.raises(RuntimeError, match=r"left \d+ modules of model type qwen2 as they were \(first: model\."):
        block_kernels.apply_kernels(_model(tiny_model_dir), "liger")


def test_liger_patched_modules_pass_the_check(tiny_model_dir: Path) -> None:
    model = _model(tiny_model_dir)
    for m in model.modules():  # what Liger's _patch_* helpers do to each module: bind its name
        if type(m).__name__.endswith(("RMSNorm", "MLP")):
            m._get_name = types.MethodType(lambda self: "LigerRMSNorm", m)  # type: ignore[method-assign]
    assert not [n for n, m in model.named_modules() if block_kernels._is_plain(m)]


def test_launch_refuses_liger_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"^trainer.kernels=liger needs trainer.device=cuda"):
        check_launch(load_config(None, ["trainer.kernels=liger", "trainer.device=cpu"]))
    with pytest.raises(ConfigError, match=r"^trainer.kernels=liger cannot run with trainer.compile=true"):
        liger_compiled = ["trainer.kernels=liger", "trainer.device=cuda", "trainer.compile=true", ONE_GPU]
        check_launch(load_config(None, liger_compiled))
    with pytest.raises(ConfigError, match=r"^trainer.kernels=liger applies to the FSDP actor only"):
        check_launch(load_config(None, ["trainer.kernels=liger", "trainer.backend=megatron"]))
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match=r"^trainer.kernels=liger needs the liger-kernel package"):
        check_launch(load_config(None, ["trainer.kernels=liger", "trainer.device=cuda", ONE_GPU]))
    with pytest.raises(ConfigError, match=r"trainer\.kernels"):
        load_config(None, ["trainer.kernels=apex"])


def test_the_trainer_benchmark_keeps_liger_out_of_its_bare_loop(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.trainer import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--out", "/tmp/unused.json", "--engine-option", "trainer.kernels=liger"])
    assert exit_info.value.code == 2 and "add --loops engine" in capsys.readouterr().err
