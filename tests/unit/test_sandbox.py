"""The sandboxed Python executor (roles/rollout/sandbox.py) as real subprocesses: normal
code prints its result; a runaway loop, a sleeper, a memory hog and a printing loop are
each stopped by their own limit; a connect to a socket the test is listening on fails;
through the tool registry every failure is an `error:` observation and a call cut by
`tool_timeout_s` leaves no process behind."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from roles.rollout.sandbox import SandboxLimits, network_isolation_unavailable, run_python
from roles.rollout.tools import ToolRegistry

NO_NETNS = network_isolation_unavailable()
# Where the kernel refuses namespaces the limits are still tested, with isolation off.
LIMITS = SandboxLimits(wall_s=60, cpu_s=1, memory_mb=256, output_chars=500, isolate_network=not NO_NETNS)


def run(code: str, limits: SandboxLimits = LIMITS) -> tuple[str, float]:
    start = time.monotonic()
    out = asyncio.run(run_python(code, limits))
    return out, time.monotonic() - start


def test_normal_code_prints_its_result() -> None:
    out, _ = run("import math\nprint(sum(range(10)), math.factorial(5))")
    assert out == "45 120\n"


def test_code_runs_in_a_throwaway_directory() -> None:
    first, _ = run("import os\nopen('note.txt', 'w').write('x')\nprint(os.getcwd())")
    workdir = Path(first.strip())
    assert workdir.name.startswith("tandem-sandbox-") and not workdir.exists()
    second, _ = run("import os\nprint(sorted(os.listdir('.')))")
    assert second == "['main.py']\n"


def test_runaway_loop_is_killed_at_its_cpu_limit() -> None:
    out, elapsed = run("while True:\n    pass")
    assert out == "error: CPU time limit (1s) reached"
    assert elapsed < LIMITS.wall_s / 2  # the CPU limit stopped it, not the wall clock


def test_sleeper_is_killed_at_its_wall_limit() -> None:
    out, elapsed = run("import time\ntime.sleep(600)", SandboxLimits(wall_s=1.0, isolate_network=not NO_NETNS))
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


@pytest.mark.skipif(bool(NO_NETNS), reason=f"no network namespace here: {NO_NETNS}")
def test_socket_connect_fails_inside_the_sandbox(listener: int) -> None:
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {listener}), timeout=5)\nprint('connected')"
    # The same program outside the sandbox reaches the listener: the test can tell.
    socket.create_connection(("127.0.0.1", listener), timeout=5).close()
    out, _ = run(code)
    assert out.startswith("error: exit status 1") and "connected" not in out
    assert "Network is unreachable" in out or "OSError" in out


def test_registry_turns_failures_into_error_observations(tmp_path: Path) -> None:
    tools = ToolRegistry(["roles.rollout.sandbox:python"], timeout_s=30.0)  # a loaded CI box starts slowly
    ok = asyncio.run(tools.call("python", {"code": "print(2 ** 10)"}))
    assert ok.ok and ok.text == "1024\n"
    failed = asyncio.run(tools.call("python", {"code": "1 / 0"}))
    assert failed.ok and failed.text.startswith("error: exit status 1") and "ZeroDivisionError" in failed.text
    bad = asyncio.run(tools.call("python", {"source": "print(1)"}))
    assert not bad.ok and bad.text.startswith("error: bad arguments for tool 'python'")
    marker = tmp_path / "still-running"
    write = f"open({str(marker)!r}, 'w').write('alive')"
    assert asyncio.run(tools.call("python", {"code": write})).ok and marker.exists()  # the sandbox can write it
    marker.unlink()
    short = ToolRegistry(["roles.rollout.sandbox:python"], timeout_s=0.5)
    cut = asyncio.run(short.call("python", {"code": f"import time\ntime.sleep(1.5)\n{write}"}))
    assert not cut.ok and cut.text == "error: tool 'python' did not return in 0.5s"
    time.sleep(2.5)  # had the child survived the cut it would have written the marker by now
    assert not marker.exists()


def test_tool_environment_runs_a_python_call_from_a_turn() -> None:
    from roles.rollout.environment import Turn
    from roles.rollout.tool_env import ToolEnv

    env = ToolEnv(ToolRegistry(["roles.rollout.sandbox:python"], timeout_s=30.0))
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call><|im_end|>'
    step = asyncio.run(env.step(Turn(index=0, token_ids=[1], text=call, finish_reason="stop")))
    response = "<tool_response>\n42\n\n</tool_response>"  # the program's output is "42\n"
    assert step.observation == f"\n<|im_start|>user\n{response}<|im_end|>\n<|im_start|>assistant\n"
    assert not step.done and (env.num_calls, env.num_errors) == (1, 0)
