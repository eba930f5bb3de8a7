"""Fault campaign: how fast a tiny CPU run ends when one of its processes is killed or frozen.

For each scenario it launches `configs/tiny_cpu.yaml` (real processes: vLLM-CPU rollout,
reward, 2-rank FSDP2 trainer, controller), waits for the first training step, then

* `kill9 ROLE`: SIGKILLs the role's process (bound: 5 s to the launcher's exit),
* `freeze ROLE`: SIGSTOPs it (bound: 2 x `transport.peer_timeout_s`: a silent peer),
* `freeze vllm-engine`: SIGSTOPs vLLM's engine processes under rollout-0, the role itself
  still answering (bound: 2 x `rollout.stall_timeout_s`),

and measures the seconds until the launcher exits, with the cause it printed. Prints one
JSON object (`scenarios`: fault, target, exit_s, bound_s, within_bound, cause).

    .venv/bin/python benchmarks/faults.py [--only kill9|freeze] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.json_out import ROOT, provenance

ROLES = ["controller-0", "rollout-0", "reward-0", "trainer-0", "trainer-1"]
PEER_TIMEOUT_S = 10.0
STALL_TIMEOUT_S = 20.0
KILL_BOUND_S = 5.0


def _launch(run_dir: Path) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "runtime.cli",
        "launch",
        "configs/tiny_cpu.yaml",
        f"run_dir={run_dir}",
        "trainer.total_steps=100000",
        f"transport.peer_timeout_s={PEER_TIMEOUT_S:g}",
        f"rollout.stall_timeout_s={STALL_TIMEOUT_S:g}",
    ]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _pid(run_dir: Path, name: str) -> int:
    for line in (run_dir / "logs" / f"{name}.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["event"] == "ready":
            return int(rec["pid"])
    raise RuntimeError(f"{name} never said ready")


def _wait_first_step(run_dir: Path, proc: subprocess.Popen[str], timeout_s: float = 300) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended before its first step: {proc.stdout.read() if proc.stdout else ''}")
        if metrics.exists() and metrics.read_text().strip():
            return
        time.sleep(0.2)
    raise RuntimeError(f"no step after {timeout_s}s")


def scenario(fault: str, target: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tandem-faults-") as tmp:
        run_dir = Path(tmp) / "run"
        proc = _launch(run_dir)
        try:
            _wait_first_step(run_dir, proc)
            if target == "vllm-engine":
                victims = psutil.Process(_pid(run_dir, "rollout-0")).children(recursive=True)
                bound = 2 * STALL_TIMEOUT_S
            else:
                victims = [psutil.Process(_pid(run_dir, target))]
                bound = KILL_BOUND_S if fault == "kill9" else 2 * PEER_TIMEOUT_S
            sig = signal.SIGKILL if fault == "kill9" else signal.SIGSTOP
            started = time.monotonic()
            for v in victims:
                os.kill(v.pid, sig)
            out, _ = proc.communicate(timeout=bound * 3 + 30)
            exit_s = time.monotonic() - started
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    died = [ln.strip() for ln in out.splitlines() if " died " in ln or "went silent" in ln or "stalled" in ln]
    cause = (died[-1] if died else out[-300:])[:300]
    return {
        "fault": fault,
        "target": target,
        "exit_s": round(exit_s, 2),
        "bound_s": bound,
        "within_bound": exit_s <= bound,
        "exit_code": proc.returncode,
        "cause": cause,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["kill9", "freeze"], default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    plan = [("kill9", r) for r in ROLES] + [("freeze", r) for r in [*ROLES, "vllm-engine"]]
    plan = [p for p in plan if args.only in (None, p[0])]
    results = []
    for fault, target in plan:
        res = scenario(fault, target)
        print(json.dumps(res), file=sys.stderr)
        results.append(res)
    report = {
        "benchmark": "faults",
        **provenance(),
        "machine": f"{platform.node()} {os.cpu_count()} cpus",
        "peer_timeout_s": PEER_TIMEOUT_S,
        "stall_timeout_s": STALL_TIMEOUT_S,
        "kill_bound_s": KILL_BOUND_S,
        "all_within_bound": all(r["within_bound"] for r in results),
        "scenarios": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
