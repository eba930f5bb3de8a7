"""Checks done before any role is spawned, each one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from runtime.config.load import load_config
from runtime.config.validate import check_config
from runtime.errors import ConfigError
from runtime.preflight import environment
from runtime.preflight.environment import check_launch
from runtime.user_functions import load_function
from runtime.views.summary import end_summary
from tests.unit.runtime.test_run_dir import fake_checkpoint


def check(*overrides: str) -> None:
    check_launch(load_config("configs/tiny_cpu.yaml", list(overrides)))


def test_gpu_only_options_are_refused_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(environment, "gpus_present", lambda: False)
    with pytest.raises(ConfigError, match=r"weight_sync\.backend=ipc needs a GPU .* use weight_sync\.backend=zmq"):
        check("weight_sync.backend=ipc")
    with pytest.raises(ConfigError, match=r"fsdp\.cpu_offload=true needs a GPU"):
        check("fsdp.cpu_offload=true")
    monkeypatch.setattr(environment, "gpus_present", lambda: True)
    check("weight_sync.backend=ipc")  # placement names no GPU: the run time check decides


def test_gpus_present_honours_an_emptied_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not environment.gpus_present()


def test_an_enabled_logger_needs_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(environment, "LOGGER_PACKAGES", {"tensorboard": "no_such_tb_pkg", "wandb": "no_such_wandb_pkg"})
    with pytest.raises(ConfigError, match=r"metrics\.tensorboard=true needs .*: pip install no_such_tb_pkg"):
        check("metrics.tensorboard=true")
    with pytest.raises(ConfigError, match=r"metrics\.wandb=true needs .*: pip install no_such_wandb_pkg"):
        check("metrics.wandb=true")
    check()  # off: nothing asked


def test_settings_that_would_be_ignored_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"data\.path is set but data\.source is synthetic .*data\.source=file"):
        check("data.path=prompts.jsonl")
    no_reward = "placement=[{role: controller}, {role: rollout}, {role: trainer, count: 2}]"
    with pytest.raises(ConfigError, match=r"reward\.functions is set but placement has no reward role"):
        check(no_reward, "reward.functions=[roles.reward.builtin:copy_task,roles.reward.builtin:copy_task]")


def test_a_module_raising_at_import_is_one_line_with_its_cause() -> None:
    with pytest.raises(ValueError) as err:
        load_function("tests.helpers.raises_at_import:score")
    assert str(err.value) == (
        "reward function 'tests.helpers.raises_at_import:score': importing 'tests.helpers.raises_at_import' "
        "failed: RuntimeError: reward table missing"
    )


def test_a_module_in_the_current_directory_gets_the_pythonpath_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_rewards_xyz.py").write_text("def score(**_):\n    return 0.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    with pytest.raises(ValueError, match=r"'my_rewards_xyz' is in the current directory.*PYTHONPATH=\."):
        load_function("my_rewards_xyz:score")
    with pytest.raises(ValueError, match=r"put its directory on PYTHONPATH"):
        load_function("elsewhere_xyz:score")


def test_the_end_summary_names_metrics_model_and_commands(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 7, "reward_mean": 0.5, "response_len_mean": 32.0, "staleness_mean": 1.0}\n'
        '{"kind": "validation", "step": 7}\n'
    )
    ckpt = fake_checkpoint(tmp_path, 7, ["controller.json", "actor/x", "hf/model.safetensors"])
    lines = end_summary(tmp_path, "wall 1m02s")
    assert lines[0] == "finished: wall 1m02s, step 7, reward_mean 0.500, response_len_mean 32.000, staleness_mean 1.000"
    assert f"  model          {ckpt / 'hf'}" in lines
    assert f"  report         tandem report {tmp_path}" in lines
    assert f"  export         tandem export {tmp_path} OUT_DIR" in lines


def test_the_config_check_asks_nothing_of_the_environment() -> None:
    """`check_config` reads the config alone (runtime/config is the bottom floor): a reward
    function that cannot be imported passes it and is refused by `check_launch`."""
    cfg = load_config(None, ["reward.functions=[no_such_module_here:score]"])
    check_config(cfg)
    with pytest.raises(ConfigError, match="no_such_module_here"):
        check_launch(cfg)
