"""The `ipc` weight-sync backend on ONE GPU: a rollout role (vLLM) on GPU 0 and the
trainer side (the trainer role's own sender, packing on the GPU) in this process on the
same GPU, handing vLLM CUDA IPC handles of its packed buckets.

Needs an NVIDIA GPU (docs/gpu-verification.md has the environment):

    VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m pytest -m gpu tests/gpu/test_weight_ipc.py -s -o addopts=""

* after an ipc (and a zmq) update every vLLM parameter's sum equals the sum of what the trainer sent
  (q/k/v and gate/up fused as vLLM fuses them; greedy tokens are no check on a random
  model: its logits are nearly tied);
* an older version is refused and the rollout keeps its version;
* a trainer killed mid-update leaves the rollout on the old version, generating, and the
  rollout abandons the update within `weight_sync.timeout_s`;
* GPU memory after 50 updates equals memory after 1 (no leaked handles or buffers);
* a colocated synchronous run sleeps vLLM (level 2) before every step, the trainer sees
  the freed memory at every step, and the weights vLLM samples from after each reload are
  the trainer's.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from runtime.memory.auto import load_settled
from tests.helpers.harness import ROOT, RoleHarness, greedy, weight_checksums
from tests.helpers.weights import TrainerSide
from transport import wire

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
TIMEOUT_S = 10.0
GPU = torch.device("cuda", 0)
# ~60 MB in bf16, 16 MiB buckets: several buckets per update, both buffers in use.
WIDE = ("model.tiny.hidden_size=1024", "model.tiny.intermediate_size=4096", "model.tiny.num_heads=8")
ENGINE = ("rollout.engine.enforce_eager=true", "rollout.engine.gpu_memory_utilization=0.3", "weight_sync.bucket_mb=16")
PROMPTS = [[5, 6, 7], [97, 98, 99, 100]]
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rollout(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RoleHarness]:
    run_dir = tmp_path_factory.mktemp("weight-ipc")
    cfg = load_settled(
        "configs/tiny_cpu.yaml",
        [f"run_dir={run_dir}", f"weight_sync.timeout_s={TIMEOUT_S}", "transport.peer_timeout_s=600",
         "trainer.total_steps=1000", *ENGINE, *WIDE],  # the memory test pushes 50 versions: past 40, the run's last
    )  # fmt: skip
    harness = RoleHarness(cfg, "rollout")
    await harness.start()
    yield harness
    await harness.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def trainer(rollout: RoleHarness) -> AsyncIterator[TrainerSide]:
    side = TrainerSide(rollout, "ipc", GPU, timeout_s=TIMEOUT_S, bucket_mb=16)
    await side.connect()
    yield side
    await side.aclose()


def weights(h: RoleHarness, scale: float) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = load_file(Path(h.cfg.run_dir) / "model" / "model.safetensors")
    return {k: (v.float() * scale).to(v.dtype).to(GPU) for k, v in tensors.items()}


def expected_sums(tensors: dict[str, torch.Tensor], vllm_names: set[str]) -> dict[str, float]:
    """What each vLLM parameter must sum to, from the HF tensors sent (fused as vLLM fuses)."""
    out: dict[str, float] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        target = ".".join(FUSED.get(p, p) for p in parts)
        if target in vllm_names:
            out[target] = out.get(target, 0.0) + float(t.double().sum())
    return out


async def test_ipc_update_writes_every_parameter(rollout: RoleHarness, trainer: TrainerSide) -> None:
    """Two updates; each vLLM parameter's sum changes by exactly what the sent tensors'
    sums changed by (the test's buckets are packed into new buffers each update, which the
    allocator hands back at the addresses of the last update's: the sender must wait for
    the packing before it hands out a handle it shared before)."""
    assert trainer.sender.backend == "ipc"
    await _check_two_updates(rollout, trainer, 1)


async def _check_two_updates(rollout: RoleHarness, side: TrainerSide, version: int) -> None:
    """Versions `version` and `version + 1`; every parameter's sum changes as sent (all
    mismatches are listed, with the sums, so a failure says which and by how much)."""
    first, second = weights(rollout, 0.5), weights(rollout, -0.25)
    result = await side.push(version, first)
    assert not result.failed, result.failed
    assert result.applied["rollout-0"].version == version
    print(f"\n{side.sender.backend} update: {result.seconds:.3f}s for {result.num_bytes / 1e6:.1f} MB, "
          f"phases {result.phases}")  # fmt: skip
    got_first = await weight_checksums(rollout)
    assert not (await side.push(version + 1, second)).failed
    got_second = await weight_checksums(rollout)
    assert (got_first.version, got_second.version) == (version, version + 1)
    names = set(got_first.sums)
    want_first, want_second = expected_sums(first, names), expected_sums(second, names)
    assert want_first and set(want_first) == names, (
        f"parameters no tensor was sent for: {sorted(names - set(want_first))}"
    )
    wrong = {}
    for name in names:
        change, want = got_second.sums[name] - got_first.sums[name], want_second[name] - want_first[name]
        if change != pytest.approx(want, rel=1e-6, abs=1e-4):
            wrong[name] = (change, want, got_first.sums[name], want_first[name])
    assert not wrong, f"{side.sender.backend}: (change, sent change, sum, sent sum) {wrong}"
    _, _, versions = await greedy(rollout, f"v{version + 1}", PROMPTS, 8)
    assert versions == {version + 1}


async def test_an_older_version_is_refused(rollout: RoleHarness, trainer: TrainerSide) -> None:
    assert not (await trainer.push(3, weights(rollout, 1.0))).failed
    started = time.monotonic()
    result = await trainer.push(2, weights(rollout, 0.5))
    err = result.failed["rollout-0"]
    assert err.phase == "bucket 0" and "refused" in str(err) and "version 3" in str(err)
    assert time.monotonic() - started < 2.0
    assert (await weight_checksums(rollout)).version == 3
    await trainer.connect()  # a failed target is dropped: connect again


def _die_mid_update(address: str, run_dir: str, version: int) -> None:
    """A trainer that sends bucket 0 of `version` by ipc, then is SIGKILLed."""
    import signal

    from runtime.memory.auto import load_settled as load
    from tests.helpers.harness import RoleHarness as Harness
    from tests.helpers.weights import TrainerSide as Side

    async def go() -> None:
        cfg = load("configs/tiny_cpu.yaml", [f"run_dir={run_dir}", *ENGINE, *WIDE])
        h = Harness(cfg, "rollout")
        h.peer = wire.PeerInfo(role="rollout", rank=0, address=address)
        side = Side(h, "ipc", GPU, timeout_s=TIMEOUT_S, bucket_mb=16, identity="trainer-doomed")
        await side.connect()
        tensors = weights(h, 0.25)
        buckets = side.packer.buckets(iter(tensors.items()))
        first = next(buckets)
        from roles.weights.transfers import IpcTransfer

        transfer = side.sender.transfer
        assert isinstance(transfer, IpcTransfer)
        reply = await transfer.send("rollout-0", side.sender.targets["rollout-0"], version, first)
        assert isinstance(reply, wire.Ack)
        os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(go())


async def test_a_trainer_killed_mid_update_leaves_the_old_version(rollout: RoleHarness, trainer: TrainerSide) -> None:
    assert rollout.peer is not None
    before = (await weight_checksums(rollout)).version
    proc = mp.get_context("spawn").Process(
        target=_die_mid_update, args=(rollout.peer.address, str(rollout.cfg.run_dir), before + 1)
    )
    started = time.monotonic()
    proc.start()
    await asyncio.get_running_loop().run_in_executor(None, proc.join, 120)
    assert proc.exitcode == -9
    log = Path(rollout.cfg.run_dir) / "logs" / "rollout-0.jsonl"
    while True:
        events = [json.loads(line) for line in log.read_text().splitlines()]
        if any(e["event"] == "weight_update_abandoned" and e.get("update") == before + 1 for e in events):
            break
        assert time.monotonic() - started < 60 + TIMEOUT_S + 5, "the rollout never abandoned the update"
        await asyncio.sleep(0.2)
    _, _, versions = await greedy(rollout, "after-kill", PROMPTS, 8)
    assert versions == {before}
    assert (await weight_checksums(rollout)).version == before
    # The real update of that version goes through (only the next version is ever taken).
    assert not (await trainer.push(before + 1, weights(rollout, 1.0))).failed


async def test_gpu_memory_is_flat_over_50_updates(rollout: RoleHarness, trainer: TrainerSide) -> None:
    base = (await weight_checksums(rollout)).version
    tensors = weights(rollout, 0.75)
    assert not (await trainer.push(base + 1, tensors)).failed
    torch.cuda.synchronize()
    after_one = torch.cuda.mem_get_info(GPU)[0]
    for v in range(base + 2, base + 51):
        assert not (await trainer.push(v, tensors)).failed
    torch.cuda.synchronize()
    after_fifty = torch.cuda.mem_get_info(GPU)[0]
    print(f"\nfree GPU memory after 1 update {after_one / 2**20:.0f} MiB, after 50 {after_fifty / 2**20:.0f} MiB")
    assert abs(after_one - after_fifty) < 64 << 20


async def test_a_zmq_update_writes_every_parameter_too(rollout: RoleHarness, trainer: TrainerSide) -> None:
    """The same check over `zmq` (staged in host memory, the same vLLM `load_weights` into the
    live GPU parameters): a fault both backends show is in the load, not in the IPC path.
    (An ipc check that fails on `model.embed_tokens.weight`, whose 259 rows vLLM pads to 320,
    while this one passes, points at vLLM's reload keeping views of the reused ipc buffer:
    roles/weights/vllm_reload.py.)"""
    side = TrainerSide(rollout, "zmq", torch.device("cpu"), timeout_s=TIMEOUT_S, bucket_mb=16)
    await side.connect()
    try:
        await _check_two_updates(rollout, side, (await weight_checksums(rollout)).version + 1)
    finally:
        await side.aclose()


def _gpu_processes_peak(stop: threading.Event, peaks: dict[int, float]) -> None:
    """Each GPU process's largest use (GB, as nvidia-smi reports it) until `stop`."""
    while not stop.wait(0.5):
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout  # fmt: skip
        for line in out.splitlines():
            pid, used = (x.strip() for x in line.split(","))
            if pid.isdigit() and used.isdigit():
                peaks[int(pid)] = max(peaks.get(int(pid), 0.0), int(used) * 2**20 / 1e9)


def test_colocated_sync_run_sleeps_vllm_and_the_trainer_gets_its_memory(tmp_path: Path) -> None:
    """vLLM sleeps at level 2 before every step (weights discarded, every update reloads
    them), the trainer sees the freed memory, and vLLM's process never holds more than its
    share of the GPU plus what a sleeping engine keeps."""
    run = tmp_path / "run"
    placement = (
        "placement=[{role: controller}, {role: reward}, {role: rollout, devices: [0]},"
        " {role: trainer, count: 1, devices: [0]}]"
    )
    overrides = [
        f"run_dir={run}", placement, "trainer.device=cuda", "rollout.max_staleness=0", "trainer.total_steps=6",
        "rollout.engine.enforce_eager=true", "rollout.engine.gpu_memory_utilization=0.5",
        # Explicit: on a large GPU `auto` keeps this tiny run awake (both fit), and sleep is what is tested.
        "rollout.engine.sleep_when_idle=true", "rollout.engine.sleep_level=2",
    ]  # fmt: skip
    stop = threading.Event()
    peaks: dict[int, float] = {}
    sampler = threading.Thread(target=_gpu_processes_peak, args=(stop, peaks), daemon=True)
    sampler.start()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "runtime.cli", "launch", "configs/tiny_cpu.yaml", *overrides],
            cwd=ROOT, capture_output=True, text=True, timeout=540,
        )  # fmt: skip
    finally:
        stop.set()
        sampler.join()
    pids = {e["proc"]: e["pid"] for e in _log(run, "launcher-0") if e["event"] == "spawned"}
    print(f"\npeak GPU use per process (GB): {[(name, round(peaks.get(pid, 0.0), 1)) for name, pid in pids.items()]}")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    total = torch.cuda.get_device_properties(GPU).total_memory / 1e9
    free = [m["cuda_free_gb"] for m in metrics]
    print(f"\ntrainer's free GPU memory per step (of {total:.0f} GB): {[round(f, 1) for f in free]}")
    rollout_log = [json.loads(line) for line in (run / "logs" / "rollout-0.jsonl").read_text().splitlines()]
    sleeps = [e for e in rollout_log if e["event"] == "engine_sleeping"]
    print(f"engine_sleeping: {len(sleeps)} times, {[e['seconds'] for e in sleeps]} s; "
          f"vLLM worker after each (GB): {[(e.get('free_gb'), e.get('reserved_gb')) for e in sleeps]}")  # fmt: skip
    kl = [m["kl_behaviour_proximal"] for m in metrics]
    print(f"kl_behaviour_proximal per step: {kl}")
    # The controller puts vLLM to sleep (level 2: weights discarded) before each step and
    # hands the trainer its batch once it is asleep, so every step sees vLLM's half of the GPU
    # free; the update after it reloads every weight, which the next step's behaviour/proximal
    # KL shows (bf16 noise, not the 1.4 of weights that are not the trainer's).
    assert len(free) == 6 and len(sleeps) == 6 and all(e["level"] == 2 for e in sleeps)
    assert min(free) > 0.55 * total
    rollout_peak = max((peaks.get(pid, 0.0) for name, pid in pids.items() if name.startswith("rollout")), default=0)
    assert 0 < rollout_peak < 0.5 * total + 4.0, f"vLLM's process held {rollout_peak:.1f} GB of its 0.5 x {total:.0f}"
    assert max(kl) < 0.01
    backends = [e for e in (json.loads(x) for x in (run / "logs" / "trainer-0.jsonl").read_text().splitlines())
                if e["event"] == "weight_sync_backend"]  # fmt: skip
    assert backends and backends[0]["backend"] == "ipc"


def _log(run: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run / "logs" / f"{name}.jsonl").read_text().splitlines()]
