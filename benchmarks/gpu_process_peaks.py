"""Peak GPU memory per Tandem role while something runs, sampled from nvidia-smi in a thread.

`PeakSampler(every_s)` is a context manager: inside it a daemon thread reads
`runtime.memory.gpu.gpu_processes` every `every_s` seconds and keeps each name's highest
figure (a role process, or vLLM's engine process counted under its rollout: `rollout-0
(VLLM::EngineCore)` becomes `rollout-0`; other processes keep their `pid N (comm)` name) and
the highest sum over all processes. nvidia-smi counts everything a process holds on the GPU
(allocator cache, CUDA context, NCCL, vLLM's pools). Where there is no nvidia-smi (a CPU
machine) nothing is recorded: `peaks` stays empty and `total_peak` 0.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType

from runtime.memory.gpu import GpuProcess, gpu_processes


def role_name(process: str) -> str:
    """The role a process's GPU memory counts under: `rollout-0 (VLLM::EngineCore)` -> `rollout-0`."""
    return process if process.startswith("pid ") else process.split(" (")[0]


class PeakSampler:
    """Each role's peak GPU memory (GB, 10^9 bytes) over the `with` block; see the module docstring."""

    def __init__(self, every_s: float = 1.0, sample: Callable[[], list[GpuProcess]] | None = None) -> None:
        self.every_s = every_s
        self._sample = sample or (lambda: gpu_processes(timeout_s=5.0))
        self.peaks: dict[str, float] = {}
        self.total_peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-peaks", daemon=True)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()

    def record(self, procs: list[GpuProcess]) -> None:
        """Fold one reading into the peaks (a role's engine process adds to the role's figure)."""
        now: dict[str, float] = {}
        for p in procs:
            name = role_name(p.name)
            now[name] = now.get(name, 0.0) + p.used_gb
        for name, gb in now.items():
            self.peaks[name] = max(self.peaks.get(name, 0.0), gb)
        self.total_peak = max(self.total_peak, sum(now.values()))

    def rounded(self) -> dict[str, float]:
        """`peaks`, by name, in GB to two decimals."""
        return {name: round(gb, 2) for name, gb in sorted(self.peaks.items())}

    def _run(self) -> None:
        while True:
            self.record(self._sample())
            if self._stop.wait(self.every_s):
                return
