"""`.ci/setup`'s `pip install -e .` printed setuptools' 9-line `BuildBackendWarning:
Editable installation` block. Building the editable wheel of this pyproject.toml (with the
venv's setuptools, no network) emits no warning and maps the three packages."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

BUILD = "from setuptools import build_meta; print(build_meta.build_editable('dist'))"


def test_the_editable_install_builds_without_a_warning(tmp_path: Path) -> None:
    setuptools = pytest.importorskip("setuptools")
    assert int(setuptools.__version__.split(".")[0]) >= 77  # pyproject.toml's build requirement
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tmp_path / name)
    for package in ("runtime", "roles", "transport"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    out = subprocess.run([sys.executable, "-c", BUILD], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert "BuildBackendWarning" not in out.stderr and "Editable installation" not in out.stderr, out.stderr
    wheel = tmp_path / "dist" / out.stdout.strip().splitlines()[-1]
    (pth,) = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".pth")]
    assert zipfile.ZipFile(wheel).read(pth).decode().strip() == str(tmp_path)
