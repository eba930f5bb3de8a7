"""The tail every role's `handle` shares (runtime/role.py `Role.unserved`): `Shutdown` stops
the role without a reply, anything else gets one BAD_REQUEST error naming the role kind and
the message type. Every role's `handle` ends with it."""

from __future__ import annotations

import ast
from pathlib import Path

from runtime.config.load import load_config
from runtime.role import Role, RoleContext
from tests.conftest import ROOT
from transport import wire


class Demo(Role):
    kind = "demo"


def test_shutdown_stops_the_role_and_anything_else_is_a_bad_request(tmp_path: Path) -> None:
    role = Demo(RoleContext(cfg=load_config(None, []), run_dir=tmp_path, role="demo", rank=0))
    try:
        reply = role.unserved(wire.WeightChecksums())
        assert isinstance(reply, wire.Error) and reply.code == wire.ErrorCode.BAD_REQUEST
        assert reply.message == "demo does not serve WeightChecksums"
        assert not role.stopping
        assert role.unserved(wire.Shutdown(reason="done")) is None
        assert role.stopping
    finally:
        role.zmq.term()


def test_every_roles_handle_ends_with_the_shared_tail() -> None:
    """No role writes its own Shutdown / unknown-message tail again (the five copies were one)."""
    handles = 0
    for path in sorted((ROOT / "roles").rglob("*.py")):
        for cls in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(cls, ast.ClassDef) and any("Role" in ast.unparse(b) for b in cls.bases)):
                continue  # only roles (a socket's own handler is not one)
            for node in cls.body:
                if isinstance(node, ast.AsyncFunctionDef) and node.name == "handle":
                    last = node.body[-1]
                    assert isinstance(last, ast.Return) and "self.unserved(" in ast.unparse(last), path
                    handles += 1
    assert handles >= 5
