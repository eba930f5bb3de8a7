"""The worker-call table (roles/weights/worker_calls.py) and vLLM's side of it agree: every
call names a public method of `TandemWorkerExtension`, every such method is in the table,
and no module calls a worker by a string of its own."""

from __future__ import annotations

import ast
import re

from roles.weights.worker_calls import WorkerCall
from tests.conftest import ROOT


def _extension_methods() -> set[str]:
    tree = ast.parse((ROOT / "roles/weights/worker_ext.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TandemWorkerExtension")
    return {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("tandem_")}


def test_the_table_is_the_extensions_public_methods() -> None:
    assert {c.value for c in WorkerCall} == _extension_methods()


def test_no_worker_call_is_spelled_as_a_string_elsewhere() -> None:
    spelled = re.compile(r"""["']tandem_(?!varlen)[a-z_]+["']""")
    found = [
        f"{path.relative_to(ROOT)}:{i}"
        for package in ("roles", "runtime", "transport")
        for path in (ROOT / package).rglob("*.py")
        if path.name != "worker_calls.py"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if spelled.search(line)
    ]
    assert not found, found
