"""One-line causes for running out of GPU memory (runtime/memory/gpu.py): torch's and vLLM's
error texts as they were seen on the H200, and processes named by their role."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from runtime.memory.gpu import GpuProcess, is_out_of_memory, out_of_memory_cause, process_name

# torch 2.11's CUDA OutOfMemoryError text, from the async bench run that died at step 3.
TORCH_OOM = (
    "CUDA out of memory. Tried to allocate 594.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which "
    "412.69 MiB is free. Process 2066 has 64.50 GiB memory in use. Including non-PyTorch memory, this process "
    "has 74.98 GiB memory in use. Of the allocated memory 73.10 GiB is allocated by PyTorch, and 1.21 GiB is "
    "reserved by PyTorch but unallocated."
)
VLLM_WAKE_OOM = "Call to wake_up method failed: CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:163"
PROCS = [GpuProcess(11, 80.5, "trainer-0"), GpuProcess(12, 64.5, "rollout-0 (VLLM::EngineCore)")]


class OutOfMemoryError(RuntimeError):
    """Named as torch's is: what `is_out_of_memory` reads is the type's name and the text."""


def test_torch_oom_names_role_phase_ask_and_holdings() -> None:
    cause = out_of_memory_cause("trainer-0", "train_step", OutOfMemoryError(TORCH_OOM), processes=PROCS,
                                config_path="runs/x/config.yaml")  # fmt: skip
    assert cause == (
        "trainer-0 ran out of GPU memory in train_step: asked 594.00 MiB with 78.5 GB allocated (79.8 GB reserved) "
        "by this process, 80.5 GB with its context; GPU 0 has 0.4 of 150.1 GB free; GPU processes: trainer-0 "
        "80.5 GB, rollout-0 (VLLM::EngineCore) 64.5 GB; the memory plan: tandem launch --plan runs/x/config.yaml"
    )


def test_vllm_wake_up_oom_uses_the_figures_it_is_given() -> None:
    exc = RuntimeError(VLLM_WAKE_OOM)
    assert is_out_of_memory(exc)
    cause = out_of_memory_cause("rollout-0", "vLLM wake_up (kv_cache)", exc, gpu=(0, 1.25, 150.1), processes=[])
    assert cause == (
        "rollout-0 ran out of GPU memory in vLLM wake_up (kv_cache): RuntimeError: " + VLLM_WAKE_OOM
        + "; GPU 0 has 1.2 of 150.1 GB free; the memory plan: tandem launch --plan CONFIG"
    )  # fmt: skip


def test_out_of_memory_is_found_through_wrapping_errors() -> None:
    try:
        try:
            raise RuntimeError(VLLM_WAKE_OOM)
        except RuntimeError as inner:
            raise ValueError("weight update failed") from inner
    except ValueError as outer:
        assert is_out_of_memory(outer)
    assert is_out_of_memory(OutOfMemoryError("anything"))
    assert not is_out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_out_of_memory(TimeoutError("vLLM engine call wake_up did not return in 60s"))


def test_processes_are_named_by_the_role_that_owns_them(tmp_path: Path) -> None:
    """A role process (titled by runtime/entry.py, or by its argv) and a child it started."""
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"  # noqa: E501
    role = subprocess.Popen([sys.executable, "-c", child, "-m", "runtime.entry", "--role", "rollout", "--rank", "3"])
    try:
        deadline = time.monotonic() + 10
        kids: list[int] = []
        while not kids and time.monotonic() < deadline:
            kids = [int(p) for p in Path(f"/proc/{role.pid}/task/{role.pid}/children").read_text().split()]
            time.sleep(0.05)
        assert process_name(role.pid) == "rollout-3"
        assert process_name(kids[0]).startswith("rollout-3 (python")
        assert process_name(os.getpid()).startswith(f"pid {os.getpid()} (")
    finally:
        for pid in kids:
            os.kill(pid, 9)
        role.kill()
        role.wait()
