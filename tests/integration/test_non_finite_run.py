"""Non-finite numbers and floods against live tiny runs.

One paced run takes, while it trains: rewards that are NaN or inf on some samples (counted
as failures, every metric finite, no traceback), a forged weight update holding NaN with the
run's token (refused where it lands, the rollout's weights unchanged by checksum), 5,000
malformed messages from 5,000 identities with the token (a few console lines, summaries
that count them all) and three 900 MB frames (the controller's memory barely moves). A
second run gets a NaN loss injected at three steps in a row: each step is skipped and
counted, the third ends the run naming it, and no checkpoint holds a non-finite weight.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import zmq
import zmq.asyncio

from runtime.config.load import load_config
from runtime.identity import addresses
from runtime.identity.run_token import read_token
from tests.conftest import ROOT
from tests.helpers.rewards import HOLD_ENV
from tests.integration.test_launcher import wait_ready
from transport import wire
from transport.rpc import RemoteError
from transport.sockets import connect_dealer

pytestmark = pytest.mark.slow
TANDEM = [sys.executable, "-m", "runtime.cli", "launch", "configs/tiny_cpu.yaml"]
STEPS = 14
FUNCTIONS = (
    "reward.functions=[roles.reward.builtin:copy_task,tests.helpers.rewards:nan_or_inf_sometimes,"
    "tests.helpers.rewards:held_zero]"
)  # fmt: skip  (held_zero: 0.25 s a call, ~1 s a step)
BIG_FRAMES = """
import sys, time, numpy as np, zmq
from transport import wire
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.plain_username, sock.plain_password = b"tandem", sys.argv[2].encode()
sock.connect(sys.argv[1])
frame = memoryview(np.zeros(900 << 20, dtype=np.uint8))  # calloc'd: the sender's pages stay untouched
head = wire.Header(wire.SCHEMA_VERSION, wire.MsgType.COMPLETION, 0, 0).pack()
sock.send_multipart([head, frame, frame, frame], copy=False)
print("sent", flush=True)
time.sleep(30)
"""


def events(run: Path, name: str, event: str) -> list[dict[str, Any]]:
    path = run / "logs" / f"{name}.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("event") == event]


def steps(run: Path) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "kind" not in r]


def options(run: Path) -> Any:
    return addresses.channel_options(load_config("configs/tiny_cpu.yaml", [f"run_dir={run}"]), run)


async def forge_nan_update(run: Path) -> tuple[str, dict[str, float], dict[str, float], int]:
    """The refusal of a whole model's update (the tiny model's own weights) with NaN in its
    last tensor, at the rollout's current version, and the rollout's checksums before and after."""
    from safetensors.torch import load_file

    weights = load_file(str(next((run / "model").glob("*.safetensors"))))
    name = sorted(weights)[-1]
    weights[name] = torch.full_like(weights[name], math.nan)
    ctx = zmq.asyncio.Context()
    address = next(e["address"] for e in events(run, "controller-0", "registered") if e["peer"] == "rollout-0")
    sock = connect_dealer(ctx, address, name="forger", identity="forger-weights", options=options(run))
    sock.start()
    token = read_token(run)
    try:
        for _ in range(5):  # a legit update may land between the two checksums: then again
            before = await sock.request(wire.WeightChecksums(token=token), timeout=30)
            assert isinstance(before, wire.WeightChecksums)
            try:
                await sock.request(wire.WeightBucket(before.version, 0, True, weights, token), timeout=30)
                refusal = "accepted"
            except RemoteError as exc:
                refusal = exc.message
            after = await sock.request(wire.WeightChecksums(token=token), timeout=30)
            assert isinstance(after, wire.WeightChecksums)
            if after.version == before.version:
                return refusal, before.sums, after.sums, before.version
        raise AssertionError("the rollout's version moved under every try")
    finally:
        await sock.aclose()
        ctx.destroy(linger=0)


async def flood(run: Path, count: int = 5_000, batch: int = 250) -> None:
    """`count` malformed messages from as many identities, each holding the run's token."""
    cfg = load_config("configs/tiny_cpu.yaml", [f"run_dir={run}"])
    address, token = addresses.controller_bind_address(cfg, run), read_token(run)
    ctx = zmq.asyncio.Context()
    ctx.set(zmq.MAX_SOCKETS, 2 * count)  # closed sockets count until their message has left (linger)
    bad = [wire.Header(wire.SCHEMA_VERSION, wire.MsgType.COMPLETION, 0, 0).pack(), b"\xc1 not msgpack"]
    try:
        for start in range(0, count, batch):
            socks = []
            for i in range(start, start + batch):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 2000)
                s.setsockopt(zmq.IDENTITY, f"flood-{i}".encode())
                s.plain_username, s.plain_password = b"tandem", token.encode()
                s.connect(address)
                socks.append(s)
            await asyncio.gather(*(s.send_multipart(bad) for s in socks))
            for s in socks:
                s.close()  # with its linger: the message leaves first
            await asyncio.sleep(0.5)  # a batch's handshakes and drops, before the next one's
    finally:
        ctx.destroy(linger=2000)


def big_frames(run: Path, controller_pid: int) -> int:
    """How many bytes the controller grew by while a token holder sent it 3 frames of 900 MB."""
    cfg = load_config("configs/tiny_cpu.yaml", [f"run_dir={run}"])
    proc = psutil.Process(controller_pid)
    before = proc.memory_info().rss
    args = [sys.executable, "-c", BIG_FRAMES, addresses.controller_bind_address(cfg, run), read_token(run)]
    sender = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    peak = before
    try:
        assert sender.stdout is not None and sender.stdout.readline() == "sent\n"
        for _ in range(30):  # 3 s
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.1)
    finally:
        sender.kill()
        sender.wait()
    return peak - before


def test_nan_rewards_a_nan_update_and_floods_leave_the_run_finite_and_quiet(tmp_path: Path) -> None:
    run, hold = tmp_path / "run", tmp_path / "hold"
    env = {**os.environ, HOLD_ENV: str(hold)}
    cmd = [*TANDEM, f"run_dir={run}", f"trainer.total_steps={STEPS}", FUNCTIONS, "reward.timeout_s=60"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        controller = wait_ready(run, "controller-0", proc)
        wait_ready(run, "rollout-0", proc)
        while not (run / "metrics.jsonl").exists() or len(steps(run)) < 3:
            assert proc.poll() is None
            time.sleep(0.2)
        hold.touch()  # the run stands still (no reward returns): no legit update races the forged one
        time.sleep(3.0)
        refusal, before, after, version = asyncio.run(forge_nan_update(run))
        hold.unlink()
        asyncio.run(flood(run))
        grew = big_frames(run, controller)
        stdout, _ = proc.communicate(timeout=600)
    finally:
        hold.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout[-3000:]
    assert "Traceback" not in stdout and "TypeError" not in stdout, stdout[-3000:]
    # NaN and inf rewards: failures by reason, the function named, every metric finite.
    recs = steps(run)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    for rec in recs:
        for key, value in rec.items():
            assert isinstance(value, int | float) and math.isfinite(value), (rec["step"], key, value)
    assert sum(r.get("reward_failures_nonfinite", 0) for r in recs) > 0
    assert all(r["reward_failures"] == r.get("reward_failures_nonfinite", 0) for r in recs)
    failed = events(run, "reward-0", "reward_call_failed")
    assert failed and failed[0]["function"] == "tests.helpers.rewards:nan_or_inf_sometimes"
    assert failed[0]["reason"] == "nonfinite" and "not a finite number" in failed[0]["error"]
    # The forged update: refused, naming the tensor; the rollout's weights as they were.
    assert "weights refused: not finite" in refusal and "holds NaN or inf" in refusal, refusal
    assert before == after and len(before) > 5, version
    assert events(run, "rollout-0", "weight_update_refused")
    # The flood: every drop counted, a few lines on the console.
    dropped = events(run, "controller-0", "message_dropped")
    summaries = events(run, "controller-0", "messages_dropped")
    # 5,000 malformed from the flood, and the big frames' message cut as oversized.
    assert len(dropped) + sum(s["unlogged"] for s in summaries) == 5_001
    assert [d["reason"] for d in dropped].count("oversized") == 1
    assert max(s["total"]["malformed"] for s in summaries) == 5_000
    console = [ln for ln in stdout.splitlines() if "message_dropped" in ln or "messages_dropped" in ln]
    print(json.dumps({"flood_console_lines": len(console), "big_frames_controller_grew_mib": grew / 2**20}))
    assert len(console) <= 50, len(console)
    # Three 900 MB frames: cut at the first one's length, the controller's cap being 64 MiB.
    assert grew <= 1.1 * (64 << 20), f"the controller grew by {grew >> 20} MiB"


def test_a_nan_loss_is_skipped_counted_and_ends_the_run_after_three_in_a_row(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {**os.environ, "TANDEM_TEST_NONFINITE_STEPS": "3,4,5"}
    cmd = [*TANDEM, f"run_dir={run}", "trainer.total_steps=10", "checkpoint.every=2"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stdout[-3000:]
    line = next((ln for ln in out.stdout.splitlines() if "role controller-0 died" in ln), out.stdout[-3000:])
    assert "step 5: the loss or gradient norm was not finite 3 steps in a row (steps 3-5" in line, line
    assert "first non-finite loss in micro-batch 0 of trainer-0" in line, line
    assert f"the last checkpoint is {run / 'checkpoints' / 'step-00000004'}" in line, line
    recs = {r["step"]: r for r in steps(run)}
    assert sorted(recs) == [1, 2, 3, 4, 5]
    assert [recs[s]["update_skipped"] for s in (1, 2, 3, 4, 5)] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert recs[3]["loss"] == "nan" and recs[5]["skipped_steps_total"] == 3.0
    assert recs[3]["nonfinite_rank"] == 0.0 and recs[3]["nonfinite_micro_batch"] == 0.0
    from safetensors.torch import load_file

    saved = sorted((run / "checkpoints").glob("step-*"))
    assert [p.name for p in saved] == ["step-00000002", "step-00000004"]
    for path in saved:
        for name, tensor in load_file(str(next((path / "hf").glob("*.safetensors")))).items():
            assert torch.isfinite(tensor.float()).all(), (path.name, name)
    # Skipped steps leave the weights as they were: step 4's checkpoint holds step 2's weights.
    two, four = (load_file(str(next((p / "hf").glob("*.safetensors")))) for p in saved)
    assert all(torch.equal(two[k], four[k]) for k in two)
