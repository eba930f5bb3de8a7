"""One-line causes for running out of GPU memory, and what the GPUs hold right now.

`out_of_memory_cause(who, phase, exc, ...)` is the cause a role dies with when CUDA ran out
of memory: the role that ran out, the phase it was in, what it asked for, what it held,
what the GPU had free and which processes held the rest, e.g.

    trainer-0 ran out of GPU memory in train_step: asked 594 MiB with 74.9 GB allocated
    (76.2 GB reserved) by this process; GPU 0 has 0.4 of 150.1 GB free; GPU processes:
    trainer-0 76.9 GB, rollout-0 (VLLM::EngineCore) 64.5 GB; the plan: tandem launch --plan CONFIG

Nothing here imports torch: the caller passes the allocator's figures when it has them (a
trainer does; a rollout's own process has no CUDA context, vLLM's engine process has).
`gpu_processes()`, `gpu_memory(uuid)` and `gpu_totals()` ask `nvidia-smi` (bounded, best
effort: nothing where there is none), so no CUDA context is made to answer them.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import one_line

GB = 1e9
TITLE_PREFIX = "tandem:"  # role processes are titled tandem:<role>-<rank>
_SIZE = r"([0-9.]+) ([KMGT]?i?B)"
_ASKED = re.compile(r"Tried to allocate ([0-9.]+ [KMGT]?i?B)")
# torch's CUDA OutOfMemoryError text (c10/cuda/CUDACachingAllocator.cpp):
_CAPACITY = re.compile(rf"GPU (\d+) has a total capacity of {_SIZE} of which {_SIZE} is free")
_IN_USE = re.compile(rf"this process has {_SIZE} memory in use")
_BY_TORCH = re.compile(rf"{_SIZE} is allocated by PyTorch, and {_SIZE} is reserved")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 1e3, "MB": 1e6, "GB": 1e9}
_OOM_WORDS = ("out of memory", "outofmemoryerror", "cudaerrormemoryallocation")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` (or what it wraps) says CUDA ran out of memory: torch's
    OutOfMemoryError, or vLLM's engine relaying a CUDA error (its text)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        text = f"{type(cur).__name__}: {cur}".lower()
        if any(word in text for word in _OOM_WORDS):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_gb: float
    name: str


def out_of_memory_cause(
    who: str,
    phase: str,
    exc: BaseException,
    *,
    allocated_gb: float | None = None,
    reserved_gb: float | None = None,
    gpu: tuple[int, float, float] | None = None,
    processes: list[GpuProcess] | None = None,
    config_path: str = "CONFIG",
) -> str:
    """The one-line cause (see the module docstring). `gpu` = (index, free GB, total GB);
    `processes` defaults to `gpu_processes()`. What torch's message says at the moment of
    failure (capacity, free, this process's use) wins over figures taken afterwards."""
    text = str(exc)
    parts = [f"{who} ran out of GPU memory in {phase}"]
    asked = _ASKED.search(text)
    if m := _CAPACITY.search(text):
        gpu = (int(m.group(1)), _gb(m.group(4), m.group(5)), _gb(m.group(2), m.group(3)))
    if m := _BY_TORCH.search(text):
        allocated_gb = _gb(m.group(1), m.group(2))
        reserved_gb = allocated_gb + _gb(m.group(3), m.group(4))
    in_use = _IN_USE.search(text)
    held = ""
    if allocated_gb is not None:
        held = f"{allocated_gb:.1f} GB allocated"
        if reserved_gb is not None:
            held += f" ({reserved_gb:.1f} GB reserved)"
        held += " by this process"
        if in_use:
            held += f", {_gb(in_use.group(1), in_use.group(2)):.1f} GB with its context"
    if asked and held:
        parts[0] += f": asked {asked.group(1)} with {held}"
    elif asked or held:
        parts[0] += f": {'asked ' + asked.group(1) if asked else held}"
    else:
        parts[0] += f": {_short(exc)}"
    if gpu is not None:
        index, free, total = gpu
        parts.append(f"GPU {index} has {free:.1f} of {total:.1f} GB free")
    procs = gpu_processes() if processes is None else processes
    if procs:
        parts.append("GPU processes: " + ", ".join(f"{p.name} {p.used_gb:.1f} GB" for p in procs))
    parts.append(f"the memory plan: tandem launch --plan {config_path}")
    return "; ".join(parts)


def gpu_processes(uuid: str = "", timeout_s: float = 5.0) -> list[GpuProcess]:
    """Every process holding GPU memory (on the GPU `uuid`, or on any), largest first,
    named by the role it belongs to where it is one of Tandem's (or a child of one)."""
    procs = []
    for fields in _smi("--query-compute-apps=pid,used_memory,gpu_uuid", timeout_s):
        if len(fields) == 3 and fields[0].isdigit() and fields[1].isdigit() and (not uuid or fields[2] == uuid):
            pid = int(fields[0])
            procs.append(GpuProcess(pid, int(fields[1]) * 2**20 / GB, process_name(pid)))
    return sorted(procs, key=lambda p: -p.used_gb)


def gpu_memory(uuid: str, timeout_s: float = 5.0) -> tuple[int, float, float] | None:
    """(index, free GB, total GB) of the GPU `uuid` as nvidia-smi sees it; None if unknown."""
    for fields in _smi("--query-gpu=uuid,index,memory.free,memory.total", timeout_s):
        if len(fields) == 4 and fields[0] == uuid and all(f.isdigit() for f in fields[1:]):
            return int(fields[1]), int(fields[2]) * 2**20 / GB, int(fields[3]) * 2**20 / GB
    return None


def gpu_totals(timeout_s: float = 5.0) -> list[float]:
    """Every GPU's memory in GB (nvidia-smi, no CUDA context made); [] where there is none."""
    return [int(f[0]) * 2**20 / GB for f in _smi("--query-gpu=memory.total", timeout_s) if f and f[0].isdigit()]


def _smi(query: str, timeout_s: float) -> list[list[str]]:
    try:
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]


def process_name(pid: int, proc: Path = Path("/proc")) -> str:
    """`trainer-0` for a role process, `rollout-0 (VLLM::EngineCore)` for a process a role
    started (up to three generations down), else `pid N (comm)`."""
    own = _comm(pid, proc)
    cur = pid
    for _ in range(4):
        role = _role_of(cur, proc)
        if role:
            return role if cur == pid else f"{role} ({own or pid})"
        parent = _parent(cur, proc)
        if parent <= 1:
            break
        cur = parent
    return f"pid {pid}" + (f" ({own})" if own else "")


def _role_of(pid: int, proc: Path) -> str:
    try:
        argv = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    args = [a.decode(errors="replace") for a in argv if a]
    if args and args[0].startswith(TITLE_PREFIX):  # runtime/entry.py's process title
        return args[0].removeprefix(TITLE_PREFIX).split()[0]
    if "runtime.entry" not in args or "--role" not in args or "--rank" not in args:
        return ""
    try:
        return f"{args[args.index('--role') + 1]}-{args[args.index('--rank') + 1]}"
    except IndexError:
        return ""


def _parent(pid: int, proc: Path) -> int:
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _comm(pid: int, proc: Path) -> str:
    try:
        return (proc / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def _gb(number: str, unit: str) -> float:
    return float(number) * _UNITS.get(unit, 1) / GB


def _short(exc: BaseException) -> str:
    return one_line(exc, 300)
