"""The per-role GPU peak sampler (benchmarks/gpu_process_peaks.py): each role's highest figure,
a rollout's vLLM engine process counted under it, the highest total; its thread samples until
the `with` block ends; nothing where nvidia-smi is missing."""

from __future__ import annotations

import shutil
import threading

import pytest

from benchmarks.gpu_process_peaks import PeakSampler, role_name
from runtime.memory.gpu import GpuProcess


def test_an_engine_process_counts_under_its_rollout_and_peaks_are_kept() -> None:
    assert role_name("rollout-0 (VLLM::EngineCore)") == "rollout-0" and role_name("trainer-0") == "trainer-0"
    assert role_name("pid 12 (python3)") == "pid 12 (python3)"
    s = PeakSampler()
    s.record([GpuProcess(1, 20.0, "rollout-0 (VLLM::EngineCore)"), GpuProcess(2, 0.5, "rollout-0"),
              GpuProcess(3, 40.0, "trainer-0")])  # fmt: skip
    s.record([GpuProcess(1, 18.0, "rollout-0 (VLLM::EngineCore)"), GpuProcess(3, 55.0, "trainer-0")])
    assert s.rounded() == {"rollout-0": 20.5, "trainer-0": 55.0}
    assert s.total_peak == pytest.approx(73.0)  # the highest sum at one reading, not the sum of peaks


def test_the_thread_samples_until_the_block_ends() -> None:
    readings = iter([[GpuProcess(1, gb, "trainer-0")] for gb in (1.0, 3.0, 2.0)])
    three = threading.Event()

    def sample() -> list[GpuProcess]:
        got = next(readings, None)
        if got is None:
            three.set()
            return []
        return got

    with PeakSampler(every_s=0.01, sample=sample) as s:
        assert three.wait(10)
    assert s.peaks == {"trainer-0": 3.0} and not s._thread.is_alive()


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: nvidia-smi reports processes")
def test_without_nvidia_smi_nothing_is_recorded() -> None:
    with PeakSampler(every_s=0.01) as s:
        pass
    assert s.peaks == {} and s.total_peak == 0.0 and s.rounded() == {}
