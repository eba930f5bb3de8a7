"""No noise around the CLI's own lines: making the tiny model (what `tandem launch` does first)
and `tandem export --merge` draw none of transformers' progress bars, and building the
package prints no setuptools deprecation block (the license is an SPDX expression, with the
Apache-2.0 text in LICENSE)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from runtime.config.load import load_config
from tests.conftest import ROOT
from tests.unit.runtime.test_export_modes import a_run

BARS = ("Writing model shards", "Loading weights", "it/s]", "%|")


def python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=240)


def test_making_the_tiny_model_draws_no_progress_bar(tmp_path: Path) -> None:
    done = python("from runtime.tiny.model import make_tiny_model; make_tiny_model('m')", tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not any(bar in done.stderr + done.stdout for bar in BARS), done.stderr
    assert (tmp_path / "m" / "model.safetensors").is_file()


@pytest.mark.timeout(300)
def test_export_merge_prints_one_line_and_no_progress_bar(tmp_path: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from roles.weights.lora_adapters import write_adapter_dir
    from runtime.checkpoints import checkpoint
    from runtime.checkpoints.base_model import MANIFEST_KEY, identity
    from runtime.config.lora_settings import adapter_config

    run, model = a_run(tmp_path, "trainer.lora.rank=8")
    lora = load_config(run / "config.yaml").trainer.lora
    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    peft_cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules))
    tmp = checkpoint.begin(run, 20)
    write_adapter_dir(get_peft_model_state_dict(get_peft_model(base, peft_cfg)), adapter_config(lora), tmp / "adapter")
    (tmp / "controller.json").write_text("{}")
    checkpoint.commit(tmp, 20, {"version": 20, MANIFEST_KEY: identity(model)})

    out = tmp_path / "merged"
    cmd = [sys.executable, "-m", "runtime.cli", "export", str(run), str(out), "--merge"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == f"tandem: wrote {out}\n"
    assert not any(bar in done.stderr for bar in BARS), done.stderr
    assert (out / "model.safetensors").is_file()


def test_the_license_is_an_spdx_expression_with_its_text_beside_it() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert project["project"]["license-files"] == ["LICENSE"]
    assert "setuptools>=77" in project["build-system"]["requires"][0]  # the first to read an SPDX license
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"] and "END OF TERMS AND CONDITIONS" in text


def test_building_the_package_metadata_warns_of_nothing(tmp_path: Path) -> None:
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "md").mkdir()
    code = "import setuptools.build_meta as b; print(b.prepare_metadata_for_build_wheel('md'))"
    done = python(code, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "deprecated" not in done.stderr.lower() and "warning" not in done.stderr.lower(), done.stderr
    metadata = next((tmp_path / "md").glob("*.dist-info/METADATA")).read_text()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
