"""The built-in sandboxed Python executor tool (`rollout.tools: [roles.rollout.sandbox:python]`).

`python(code)` runs the model's code in a fresh interpreter (`python -I`) inside namespaces
of its own (roles/rollout/sandbox_boot.py sets them up; its docs list them) and answers
with what it printed. What a caller may rely on (the bounds are `SandboxLimits`, the
defaults `LIMITS`):
* wall time: at `wall_s` (or when the awaiting task is cancelled, e.g. by the registry's
  `rollout.tool_timeout_s`) the code's PID namespace is killed as a whole, a process that
  called `setsid` or forked included, and `run_python` returns within about a second
  whatever the program does; nothing outlives a call;
* CPU time, address space (an allocation over it fails with MemoryError), file size, open
  files and processes (`RLIMIT_NPROC`: a fork over it fails), set before the code starts;
* output: stdout and stderr together are capped at `output_chars`; a process that prints
  more is killed and its output cut;
* isolation: an unprivileged uid (65534 where the caller is root) with no capabilities; a
  root of its own (read-only system and interpreter files, empty /tmp and working
  directory, its own /proc; none of the host's /etc, /home, /root, /run, run directories
  or their unix sockets); no network interface up, not even loopback. Where any of this
  cannot be set up here the tool refuses to run code (fail closed) and says why in one
  line; there is no weaker mode;
* every failure (limit hit, exception in the code, sandbox unavailable) is returned as
  text starting `error:`; `python` itself raises only on cancellation.
Kernel-level isolation (namespaces and rlimits, as unprivileged containers use), not a
virtual machine: a kernel exploit escapes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from roles.rollout.tools import MAX_RESULT_CHARS

SETUP_FAILED_EXIT = 97  # the bootstrap's exit status when it could not isolate the code
BOOT = str(Path(__file__).with_name("sandbox_boot.py"))
STOP_GRACE_S = 0.4  # after SIGTERM, the bootstrap has this long to kill the namespace


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    output_chars: int = MAX_RESULT_CHARS
    file_mb: int = 16
    open_files: int = 64
    processes: int = 32  # processes and threads of the code (the sandbox's init counts too)


LIMITS = SandboxLimits()


async def python(code: str) -> str:
    """Run `code` (a Python program) in the sandbox with the default `LIMITS`; its output."""
    return await run_python(code, LIMITS)


async def run_python(code: str, limits: SandboxLimits) -> str:
    """`code`'s stdout and stderr (cut at `limits.output_chars`), or an `error: ...` line
    (plus whatever it printed) when it failed or hit a limit. See the module docs."""
    with tempfile.TemporaryDirectory(prefix="tandem-sandbox-") as workdir:
        code_path = os.path.join(workdir, "main.py")
        with open(code_path, "w", encoding="utf-8") as f:
            f.write(code)
        proc = await asyncio.create_subprocess_exec(
            *_argv(limits, code_path),
            env=_env(),
            start_new_session=True,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            async with asyncio.timeout(limits.wall_s):
                output, overflow = await _read_capped(proc, limits.output_chars)
                status = await proc.wait()
        except TimeoutError:
            return _error(f"wall time limit ({limits.wall_s:g}s) reached", b"", limits)
        finally:
            await _stop(proc)
    return _outcome(status, output, overflow, limits)


def isolation_unavailable() -> str:
    """Empty when the sandbox can isolate code here, else the reason it cannot (runs one
    tiny sandboxed program; for tests and start-up checks)."""
    out = asyncio.run(run_python("pass", SandboxLimits(wall_s=30)))
    return out.removeprefix("error: ") if out else ""


def _argv(limits: SandboxLimits, code_path: str) -> list[str]:
    nums = (limits.cpu_s, limits.memory_mb, limits.file_mb, limits.open_files, limits.processes)
    return [sys.executable, "-I", "-B", BOOT, *map(str, nums), code_path]


def _env() -> dict[str, str]:
    """A minimal environment: no proxies, tokens or library paths of the role leak in."""
    return {"PATH": "/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}


async def _read_capped(proc: asyncio.subprocess.Process, limit: int) -> tuple[bytes, bool]:
    """Read the merged output up to `limit` bytes (one over it means overflow, and a kill)."""
    assert proc.stdout is not None
    buf = bytearray()
    while chunk := await proc.stdout.read(65536):
        buf += chunk
        if len(buf) > limit:
            _signal(proc, signal.SIGTERM)
            await _finish(proc)
            return bytes(buf[:limit]), True
    return bytes(buf), False


async def _finish(proc: asyncio.subprocess.Process) -> None:
    """Drop the rest of the output and wait for the exit (asyncio's `wait` also waits for
    the pipe to close, which an unread full pipe never does)."""
    assert proc.stdout is not None
    while await proc.stdout.read(65536):
        pass
    await proc.wait()


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """Kill the code's namespace (the bootstrap does on SIGTERM), then the bootstrap; at
    most 2 x `STOP_GRACE_S`, whatever the program does."""
    if proc.returncode is None:
        _signal(proc, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_finish(proc), STOP_GRACE_S)
    if proc.returncode is None:  # its init dies with it (PR_SET_PDEATHSIG)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_finish(proc), STOP_GRACE_S)


def _signal(proc: asyncio.subprocess.Process, signum: int) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signum)


def _outcome(status: int, output: bytes, overflow: bool, limits: SandboxLimits) -> str:
    if overflow:
        return _error(f"output over {limits.output_chars} characters, process killed", output, limits)
    if status == SETUP_FAILED_EXIT and output.startswith(b"sandbox: "):
        reason = output.decode(errors="replace").strip().splitlines()[-1].removeprefix("sandbox: ")
        return f"error: sandbox cannot isolate code here ({reason}); code not run"
    signum = -status if status < 0 else status - 128 if status > 128 else 0
    if signum in (signal.SIGXCPU, signal.SIGKILL):  # the soft and the hard RLIMIT_CPU
        return _error(f"CPU time limit ({limits.cpu_s}s) reached", output, limits)
    if signum:
        return _error(f"killed by signal {signal.Signals(signum).name}", output, limits)
    text = output.decode(errors="replace")
    if status != 0:
        last = (text.strip().splitlines() or [""])[-1]
        what = f"memory limit ({limits.memory_mb} MiB) reached" if last.startswith("MemoryError") else ""
        return _error(what or f"exit status {status}", output, limits)
    return text


def _error(what: str, output: bytes, limits: SandboxLimits) -> str:
    head = f"error: {what}"
    text = output.decode(errors="replace")
    return f"{head}\n{text}"[: limits.output_chars] if text else head
