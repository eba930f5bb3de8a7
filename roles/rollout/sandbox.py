"""The built-in sandboxed Python executor tool (`rollout.tools: [roles.rollout.sandbox:python]`).

`python(code)` runs the model's code in a fresh interpreter (`python -I`, a subprocess of
its own session) in a throw-away working directory, and answers with what it printed.
What a caller may rely on (the bounds are `SandboxLimits`, the defaults `LIMITS`):
* wall time: the process group is killed after `wall_s` (and whenever the awaiting task
  is cancelled, e.g. by the registry's `rollout.tool_timeout_s`); nothing outlives a call;
* CPU time (`RLIMIT_CPU`), address space (`RLIMIT_AS`: an allocation over it fails with
  MemoryError), file size (`RLIMIT_FSIZE`) and open files (`RLIMIT_NOFILE`), set in the
  child before the code starts;
* output: stdout and stderr together are capped at `output_chars`; a process that prints
  more is killed and its output cut;
* no network: the code runs in new user, network and PID namespaces (`unshare(2)`; works
  unprivileged where the kernel allows user namespaces, and as root). The new network
  namespace has no interface up, not even loopback, so every connect fails. Where no
  namespace can be made the tool refuses to run code (fail closed) and says why;
  `SandboxLimits(isolate_network=False)` opts out explicitly;
* every failure (limit hit, exception in the code, sandbox unavailable) is returned as
  text starting `error:`; `python` itself raises only on cancellation.
This is a resource and network fence for model-written code, not a security boundary
against a hostile program (the file system is visible read-only-as-the-user); run
untrusted workloads in a container as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
from dataclasses import dataclass

from roles.rollout.tools import MAX_RESULT_CHARS

NO_NAMESPACE_EXIT = 97  # the bootstrap's exit status when it could not isolate the network


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    output_chars: int = MAX_RESULT_CHARS
    file_mb: int = 16
    open_files: int = 64
    isolate_network: bool = True


LIMITS = SandboxLimits()

# Runs first in the child: namespaces, then limits, then exec of a fresh interpreter on
# the code (so the code sees none of this). PID 1 of the new PID namespace is the code;
# when it exits the kernel kills anything it left behind.
_BOOTSTRAP = r"""
import ctypes, os, resource, sys
cpu, mem, fsize, nofile, isolate = (int(a) for a in sys.argv[1:6])
if isolate:
    libc = ctypes.CDLL(None, use_errno=True)
    NEWUSER, NEWNET, NEWPID = 0x10000000, 0x40000000, 0x20000000
    if libc.unshare(NEWUSER | NEWNET | NEWPID) != 0 and libc.unshare(NEWNET | NEWPID) != 0:
        sys.stderr.write("unshare: " + os.strerror(ctypes.get_errno()))
        os._exit(97)
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem << 20, mem << 20))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize << 20, fsize << 20))
resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
argv = [sys.executable, "-I", "-B", "main.py"]
if not isolate:
    os.execv(sys.executable, argv)
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, argv)
_, status = os.waitpid(pid, 0)
os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
"""


async def python(code: str) -> str:
    """Run `code` (a Python program) in the sandbox with the default `LIMITS`; its output."""
    return await run_python(code, LIMITS)


async def run_python(code: str, limits: SandboxLimits) -> str:
    """`code`'s stdout and stderr (cut at `limits.output_chars`), or an `error: ...` line
    (plus whatever it printed) when it failed or hit a limit. See the module docs."""
    with tempfile.TemporaryDirectory(prefix="tandem-sandbox-") as workdir:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        proc = await asyncio.create_subprocess_exec(
            *_argv(limits), cwd=workdir, env=_env(workdir), start_new_session=True,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        try:
            async with asyncio.timeout(limits.wall_s):
                output, overflow = await _read_capped(proc, limits.output_chars)
                status = await proc.wait()
        except TimeoutError:
            return _error(f"wall time limit ({limits.wall_s:g}s) reached", b"", limits)
        finally:
            _kill(proc)
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                await proc.wait()
    return _outcome(status, output, overflow, limits)


def network_isolation_unavailable() -> str:
    """Empty when the sandbox can isolate the network here, else the reason it cannot (runs
    one tiny sandboxed program; for tests and start-up checks)."""
    out = asyncio.run(run_python("pass", SandboxLimits(wall_s=30)))
    return out.removeprefix("error: ") if out else ""


def _argv(limits: SandboxLimits) -> list[str]:
    nums = (limits.cpu_s, limits.memory_mb, limits.file_mb, limits.open_files, int(limits.isolate_network))
    return [sys.executable, "-I", "-B", "-c", _BOOTSTRAP, *map(str, nums)]


def _env(workdir: str) -> dict[str, str]:
    """A minimal environment: no proxies, tokens or library paths of the role leak in."""
    return {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}


async def _read_capped(proc: asyncio.subprocess.Process, limit: int) -> tuple[bytes, bool]:
    """Read the merged output up to `limit` bytes (one over it means overflow, and a kill)."""
    assert proc.stdout is not None
    buf = bytearray()
    while chunk := await proc.stdout.read(65536):
        buf += chunk
        if len(buf) > limit:
            _kill(proc)
            return bytes(buf[:limit]), True
    return bytes(buf), False


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def _outcome(status: int, output: bytes, overflow: bool, limits: SandboxLimits) -> str:
    if overflow:
        return _error(f"output over {limits.output_chars} characters, process killed", output, limits)
    if status == NO_NAMESPACE_EXIT and output.startswith(b"unshare:"):
        reason = output.decode(errors="replace")
        return f"error: sandbox cannot isolate the network here ({reason}); code not run"
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
