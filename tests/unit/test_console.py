"""The launcher's console prints any log line as text: rich markup in a field is not markup."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console as RichConsole

from runtime.config_load import load_config
from runtime.console import Console


def test_markup_like_text_in_a_log_line_is_printed_verbatim(tmp_path: Path) -> None:
    console = Console(tmp_path, load_config("configs/tiny_cpu.yaml", []))
    buf = io.StringIO()
    console.out = RichConsole(file=buf, highlight=False, soft_wrap=True, width=300)
    cause = "gloo failed [/opt/gloo/transport/tcp/pair.cc:598] Connection closed by peer [bold]"
    console.show({"level": "error", "event": "fatal", "role": "trainer", "rank": 0, "cause": cause})
    console.error(f"role trainer-0 died; last error: {cause}")
    console.note("[/not markup]")
    out = buf.getvalue()
    assert out.count(cause) == 2 and "[/not markup]" in out
