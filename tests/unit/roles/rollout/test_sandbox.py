"""The sandboxed Python executor (roles/rollout/sandbox.py) as real subprocesses: normal
code prints its result; a runaway loop, a sleeper, a `setsid` sleeper, a memory hog, a
printing loop and a fork bomb are each stopped by their own limit; a connect to a TCP or
unix socket the test is listening on fails; the host's /etc/shadow, a run's token and the
host's processes are out of sight; through the tool registry every failure is an `error:`
observation and a call cut by `tool_timeout_s` leaves no process behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from roles.rollout.sandbox import SandboxLimits, isolation_unavailable, run_python
from roles.rollout.tools import ToolRegistry

NO_ISOLATION = isolation_unavailable()
# The sandbox refuses to run code without its namespaces (tested below); the rest needs them.
pytestmark = pytest.mark.skipif(bool(NO_ISOLATION), reason=f"no sandbox here: {NO_ISOLATION}")
LIMITS = SandboxLimits(wall_s=60, cpu_s=1, memory_mb=256, output_chars=500)


def run(code: str, limits: SandboxLimits = LIMITS) -> tuple[str, float]:
    start = time.monotonic()
    out = asyncio.run(run_python(code, limits))
    return out, time.monotonic() - start


def test_normal_code_prints_its_result() -> None:
    out, _ = run("import math\nprint(sum(range(10)), math.factorial(5))")
    assert out == "45 120\n"


def test_code_runs_in_a_throwaway_directory() -> None:
    first, _ = run("import os\nopen('note.txt', 'w').write('x')\nprint(os.getcwd())")
    assert first == "/sandbox\n"
    second, _ = run("import os\nprint(sorted(os.listdir('.')))")
    assert second == "['main.py']\n"


def test_runaway_loop_is_killed_at_its_cpu_limit() -> None:
    out, elapsed = run("while True:\n    pass")
    assert out == "error: CPU time limit (1s) reached"
    assert elapsed < LIMITS.wall_s / 2  # the CPU limit stopped it, not the wall clock


def test_sleeper_is_killed_at_its_wall_limit() -> None:
    out, elapsed = run("import time\ntime.sleep(600)", SandboxLimits(wall_s=1.0))
    assert out == "error: wall time limit (1s) reached"
    assert elapsed < 10


def test_memory_hog_is_stopped_at_its_memory_limit() -> None:
    out, _ = run("blocks = [bytearray(64 << 20) for _ in range(64)]\nprint('allocated 4 GiB')")
    assert out.startswith("error: memory limit (256 MiB) reached")
    assert "allocated" not in out


def test_output_is_capped_and_the_printer_killed() -> None:
    out, elapsed = run("while True:\n    print('y' * 100)")
    assert out.startswith("error: output over 500 characters, process killed\nyyy")
    assert len(out) <= 500 and elapsed < LIMITS.wall_s / 2


def test_exception_comes_back_with_its_traceback() -> None:
    out, _ = run("raise ValueError('bad input')")
    assert out.startswith("error: exit status 1\n") and out.rstrip().endswith("ValueError: bad input")


@pytest.fixture
def listener() -> Iterator[int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    try:
        yield srv.getsockname()[1]
    finally:
        srv.close()


def test_socket_connect_fails_inside_the_sandbox(listener: int) -> None:
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {listener}), timeout=5)\nprint('connected')"
    # The same program outside the sandbox reaches the listener: the test can tell.
    socket.create_connection(("127.0.0.1", listener), timeout=5).close()
    out, _ = run(code)
    assert out.startswith("error: exit status 1") and "connected" not in out
    assert "Network is unreachable" in out or "OSError" in out


def test_registry_turns_failures_into_error_observations() -> None:
    tools = ToolRegistry(["roles.rollout.sandbox:python"], timeout_s=30.0)  # a loaded CI box starts slowly
    ok = asyncio.run(tools.call("python", {"code": "print(2 ** 10)"}))
    assert ok.ok and ok.text == "1024\n"
    failed = asyncio.run(tools.call("python", {"code": "1 / 0"}))
    assert failed.ok and failed.text.startswith("error: exit status 1") and "ZeroDivisionError" in failed.text
    bad = asyncio.run(tools.call("python", {"source": "print(1)"}))
    assert not bad.ok and bad.text.startswith("error: bad arguments for tool 'python'")
    short = ToolRegistry(["roles.rollout.sandbox:python"], timeout_s=0.5)
    cut = asyncio.run(short.call("python", {"code": "import time\ntime.sleep(60)"}))
    assert not cut.ok and cut.text == "error: tool 'python' did not return in 0.5s"
    assert sandboxed_processes() == []


def test_tool_environment_runs_a_python_call_from_a_turn() -> None:
    from roles.rollout.environment import Turn
    from roles.rollout.tool_env import ToolEnv

    env = ToolEnv(ToolRegistry(["roles.rollout.sandbox:python"], timeout_s=30.0))
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call><|im_end|>'
    step = asyncio.run(env.step(Turn(index=0, token_ids=[1], text=call, finish_reason="stop")))
    response = "<tool_response>\n42\n\n</tool_response>"  # the program's output is "42\n"
    assert step.observation == f"\n<|im_start|>user\n{response}<|im_end|>\n<|im_start|>assistant\n"
    assert not step.done and (env.num_calls, env.num_errors) == (1, 0)


def sandboxed_processes() -> list[str]:
    """Host processes that are sandbox bootstraps or sandboxed programs."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"sandbox_boot.py" in cmd or cmd.endswith(b"-I\0-B\0main.py\0"):
                found.append(f"{pid}: {cmd!r}")
    return found


def test_setsid_child_is_killed_with_its_namespace_at_wall_s() -> None:
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nos.setsid()\ntime.sleep(60)"
    out, elapsed = run(code, SandboxLimits(wall_s=1.0))
    assert out == "error: wall time limit (1s) reached"
    assert elapsed < 1.0 + 1.0
    assert sandboxed_processes() == []


def test_a_fork_bomb_stops_at_the_process_limit() -> None:
    code = (
        "import os, time\nn = 0\ntry:\n    for _ in range(512):\n        if os.fork() == 0:\n"
        "            time.sleep(5)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n"
        "    print(n, e.errno)"
    )
    out, elapsed = run(code, SandboxLimits(wall_s=30, processes=16))
    num_forked, errno_ = map(int, out.split())
    assert num_forked < 16 and errno_ == 11  # EAGAIN
    assert elapsed < 5  # the init's exit killed the sleepers


def test_host_secrets_and_run_files_are_out_of_sight(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "keys").mkdir(parents=True)
    (run_dir / "keys" / "run_token").write_text("secret")
    probe = f"""
import os
for path in ["/etc/shadow", {str(run_dir / "keys" / "run_token")!r}, "/etc/passwd", "/home", "/run"]:
    try:
        open(path).read() if path.startswith("/etc") or "token" in path else os.listdir(path)
        print("read", path)
    except OSError as e:
        print(type(e).__name__)
cmdlines = [open(f"/proc/{{p}}/cmdline", "rb").read() for p in os.listdir("/proc") if p.isdigit()]
print(len(cmdlines), any(b"run_dir" in c or b"pytest" in c for c in cmdlines))
uid_map = open("/proc/self/uid_map").read().split() if os.path.exists("/proc/self") else None
print(os.getuid(), uid_map)
for path in ["/usr/evil", "/tmp/ok", "/sandbox/ok"]:
    try:
        open(path, "w").write("x")
        print("wrote", path)
    except OSError as e:
        print(type(e).__name__)
"""
    out, _ = run(probe)
    lines = out.splitlines()
    assert lines[:5] == ["FileNotFoundError"] * 5, out
    num_procs, saw_host = lines[5].split()
    assert int(num_procs) <= 3 and saw_host == "False"  # its init, its interpreter (+ ps-like)
    uid, mapping = lines[6].split(" ", 1)
    outer = "65534" if os.geteuid() == 0 else str(os.geteuid())
    assert uid == "0" and mapping in (str(["0", outer, "1"]), "None")  # None: no /proc in this container
    assert lines[7:] == ["OSError", "wrote /tmp/ok", "wrote /sandbox/ok"], out


def test_unix_socket_of_a_run_cannot_be_reached(tmp_path: Path) -> None:
    path = str(tmp_path / "controller.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen()
    try:
        socket.socket(socket.AF_UNIX).connect(path)  # reachable outside
        code = f"import socket\nsocket.socket(socket.AF_UNIX).connect({path!r})\nprint('connected')"
        out, _ = run(code)
    finally:
        srv.close()
    assert out.startswith("error: exit status 1") and "connected" not in out
    assert "FileNotFoundError" in out


def test_refuses_to_run_code_without_isolation(monkeypatch: pytest.MonkeyPatch) -> None:
    from roles.rollout import sandbox

    monkeypatch.setattr(sandbox, "_argv", lambda limits, code_path: [sys.executable, "-c", FAIL_BOOT])
    out, _ = run("print('ran')")
    assert out == "error: sandbox cannot isolate code here (unshare(user): Operation not permitted); code not run"


FAIL_BOOT = "import os\nos.write(2, b'sandbox: unshare(user): Operation not permitted\\n')\nos._exit(97)"
