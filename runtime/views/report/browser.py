"""Headless Chromium for the report: its DOM after the scripts ran (the tests read the
page's `data-status` and count drawn plots from it) and a PNG screenshot (`--png`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--hide-scrollbars",
    "--virtual-time-budget=5000",
    "--no-first-run",
    "--disable-extensions",
)


def find_chromium() -> str | None:
    """The path of a Chromium (or Chrome) on PATH, or None."""
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


def _run(args: list[str], timeout_s: float) -> str:
    exe = find_chromium()
    if exe is None:
        raise FileNotFoundError("no chromium on PATH (Debian: apt-get install chromium)")
    out = subprocess.run([exe, *FLAGS, *args], capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"chromium exited {out.returncode}: {out.stderr[-2000:]}")
    return out.stdout


def dump_dom(page: Path, *, width: int = 800, height: int = 600, timeout_s: float = 120.0) -> str:
    """The page's DOM, serialised after its scripts ran in a `width` × `height` window."""
    return _run(["--dump-dom", f"--window-size={width},{height}", page.resolve().as_uri()], timeout_s)


def screenshot(page: Path, png: Path, *, width: int = 1400, height: int = 2400, timeout_s: float = 120.0) -> Path:
    """A `width` × `height` PNG of the page, written to `png`."""
    png.parent.mkdir(parents=True, exist_ok=True)
    _run([f"--screenshot={png.resolve()}", f"--window-size={width},{height}", page.resolve().as_uri()], timeout_s)
    return png
