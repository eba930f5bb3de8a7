"""Peak GPU memory per role while a command runs, as nvidia-smi sees it. Prints JSON.

Runs COMMAND, samples `nvidia-smi --query-compute-apps` every `--every-s` seconds until it
exits, names each process by the Tandem role it belongs to (runtime/memory/gpu.py: a role
process, or vLLM's engine process, added to its rollout's figure) and reports each name's peak
in GB (10^9 bytes) with the command's exit code (benchmarks/gpu_process_peaks.py). nvidia-smi
counts everything a process holds on the GPU (allocator cache, CUDA context, NCCL, vLLM's
pools), so a trainer's figure is above its `cuda_peak_gb` (the allocator's allocated peak).

    python3 benchmarks/gpu_peaks.py --out peaks.json -- python3 -m runtime.cli launch configs/bench_1.5b.yaml
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu_process_peaks import PeakSampler
from benchmarks.json_out import provenance


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every-s", type=float, default=1.0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command given")
    started = time.monotonic()
    with PeakSampler(args.every_s) as sampler:
        proc = subprocess.Popen(command)
        proc.wait()
    result = {
        "command": command,
        "exit_code": proc.returncode,
        "seconds": round(time.monotonic() - started, 1),
        "peak_gb_by_process": sampler.rounded(),
        "peak_gb_all_processes": round(sampler.total_peak, 2),
        **provenance(),
    }
    print(json.dumps(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
