"""`tandem export` writes files a user's other tools can read: the modes a new file gets
under the exporting user's umask (0644 under 022), not safetensors' 0600; and a LoRA
export's `adapter_config.json` names its base model, so `AutoPeftModelForCausalLM` loads
the exported folder alone."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.checkpoints import checkpoint
from runtime.checkpoints.base_model import MANIFEST_KEY, identity
from runtime.config.load import load_config, to_yaml
from runtime.config.lora_settings import adapter_config
from runtime.tiny.model import make_tiny_model
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(300)


def export(run: Path, out: Path, *, umask: int) -> None:
    cmd = [sys.executable, "-m", "runtime.cli", "export", str(run), str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, umask=umask)
    assert done.returncode == 0, done.stderr[-2000:]


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*")}


def a_run(tmp_path: Path, *overrides: str) -> tuple[Path, Path]:
    """A run directory as the launcher leaves it: config.yaml and the tiny base model."""
    run = tmp_path / "run"
    cfg = load_config("configs/tiny_cpu.yaml", [f"run_dir={run}", *overrides])
    model = make_tiny_model(run / "model", seed=0)
    (run / "config.yaml").write_text(to_yaml(cfg))
    return run, Path(model)


@pytest.mark.parametrize(("umask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_an_exported_model_has_the_modes_of_a_new_file(
    tmp_path: Path, umask: int, file_mode: int, dir_mode: int
) -> None:
    run, model = a_run(tmp_path)
    tmp = checkpoint.begin(run, 20)
    shutil.copytree(model, tmp / "hf")  # as saved by save_pretrained: safetensors writes 0600
    assert stat.S_IMODE((tmp / "hf" / "model.safetensors").stat().st_mode) == 0o600
    checkpoint.commit(tmp, 20, {"version": 20})
    out = tmp_path / "out"
    export(run, out, umask=umask)
    got = modes(out)
    assert "model.safetensors" in got and "config.json" in got
    assert {m for name, m in got.items() if (out / name).is_file()} == {file_mode}
    assert stat.S_IMODE(out.stat().st_mode) == dir_mode


def test_a_lora_export_names_its_base_model_and_loads_alone(tmp_path: Path) -> None:
    from peft import AutoPeftModelForCausalLM, LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from roles.weights.lora_adapters import write_adapter_dir

    run, model = a_run(tmp_path, "trainer.lora.rank=8")
    lora = load_config(run / "config.yaml").trainer.lora
    fields = adapter_config(lora)  # what the trainer writes into a checkpoint's adapter/
    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    peft_cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules))
    tuned = get_peft_model(base, peft_cfg)
    for name, p in tuned.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)  # B starts at zero: make the adapter do something
    tensors = get_peft_model_state_dict(tuned)
    tmp = checkpoint.begin(run, 20)
    write_adapter_dir(tensors, fields, tmp / "adapter")
    (tmp / "controller.json").write_text("{}")
    checkpoint.commit(tmp, 20, {"version": 20, MANIFEST_KEY: identity(model)})

    out = tmp_path / "adapter"
    export(run, out, umask=0o022)
    written = json.loads((out / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == str(model.resolve())
    assert {k: v for k, v in written.items() if k != "base_model_name_or_path"} == fields
    assert set(modes(out).values()) == {0o644}

    loaded = AutoPeftModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()  # the folder alone
    ids = torch.tensor([[5, 6, 7, 97, 98, 99]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, tuned.eval()(ids).logits, atol=1e-5)
