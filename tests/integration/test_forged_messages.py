"""Forged control messages against a live run. Another process of the
same user can reach the run's ipc sockets; without the run's secret it can neither
register, nor declare a healthy role dead, nor take a live role's identity, nor send
weights. Each forgery is refused and counted, and the run completes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq.asyncio

from runtime.config.load import load_config
from runtime.identity import addresses
from runtime.identity.run_token import read_token
from tests.conftest import ROOT
from tests.integration.test_launcher import wait_ready
from transport import wire
from transport.rpc import RemoteError
from transport.sockets import connect_dealer

pytestmark = pytest.mark.slow
STEPS = 25  # with the paced reward, ~30 s: the forgeries (a few seconds) land mid-run


def events(run: Path, name: str, event: str) -> list[dict]:
    path = run / "logs" / f"{name}.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("event") == event]


async def forge(run: Path) -> dict[str, str]:
    """Each forgery's outcome: the refusal's text, or "no reply"."""
    cfg = load_config("configs/tiny_cpu.yaml", [f"run_dir={run}"])
    opts = addresses.channel_options(cfg, run)
    ctx = zmq.asyncio.Context()
    out: dict[str, str] = {}
    controller = connect_dealer(
        ctx, addresses.controller_bind_address(cfg, run), name="forger", identity="forger-1", options=opts
    )
    controller.start()
    try:
        secret = read_token(run)  # with the secret, placement still decides who may join
        for label, peer, token in [
            ("bogus role", wire.PeerInfo(role="bogus", rank=0), secret),
            ("undeclared rank", wire.PeerInfo(role="trainer", rank=7), secret),
            ("taken rank", wire.PeerInfo(role="trainer", rank=1), secret),
            ("no token", wire.PeerInfo(role="reward", rank=1), ""),
            ("wrong token", wire.PeerInfo(role="rollout", rank=0), "0" * 64),
        ]:
            try:
                await controller.request(wire.Register(peer=peer, token=token), timeout=10)
                out[label] = "accepted"
            except RemoteError as exc:
                out[label] = exc.message
        await controller.send(wire.Dead(role="trainer", rank=0, cause="forged"))
        # A connection that presents a live role's identity is rejected by the ROUTER.
        impostor = connect_dealer(ctx, controller.address, name="impostor", identity="trainer-0", options=opts)
        impostor.start()
        await impostor.send(wire.Dead(role="trainer", rank=0, cause="forged by an impostor"))
        await asyncio.sleep(1.0)
        await impostor.aclose()
        rollout_weights = next(
            e["address"] for e in events(run, "controller-0", "registered") if e["peer"] == "rollout-0"
        )
        weights = connect_dealer(ctx, rollout_weights, name="forger-weights", identity="forger-2", options=opts)
        weights.start()
        try:
            await weights.request(wire.WeightBucket(version=10**9, index=0, last=True, tensors={}), timeout=10)
            out["weights"] = "accepted"
        except RemoteError as exc:
            out["weights"] = exc.message
        await weights.aclose()
    finally:
        await controller.aclose()
        ctx.destroy(linger=0)
    return out


def test_forged_messages_are_refused_and_the_run_completes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "runtime.cli", "launch", "configs/tiny_cpu.yaml", f"run_dir={run}"]
    paced = "reward.functions=[roles.reward.builtin:copy_task,tests.helpers.rewards:slow_zero]"  # ~1 s a step
    proc = subprocess.Popen(
        [*cmd, f"trainer.total_steps={STEPS}", paced, "reward.concurrency=16"],  # 16 workers: 64 x 0.25 s
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_ready(run, "controller-0", proc)
        deadline = time.monotonic() + 300
        while not events(run, "controller-0", "all_registered"):
            assert proc.poll() is None and time.monotonic() < deadline, "the run never got going"
            time.sleep(0.2)
        outcomes = asyncio.run(forge(run))
        stdout, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout[-3000:]
    assert "is not in this run's placement" in outcomes["bogus role"]
    assert "trainer rank 7 is not in this run's placement" in outcomes["undeclared rank"]
    assert "trainer-1 is already registered" in outcomes["taken rank"]
    assert "no valid run token" in outcomes["no token"] and "no valid run token" in outcomes["wrong token"]
    assert "no valid run token" in outcomes["weights"]
    refused = events(run, "controller-0", "control_message_refused")
    assert sum(e["kind"] == "registration" for e in refused) == 5
    assert sum(e["kind"] == "dead" for e in refused) == 1  # the impostor's never arrived
    assert events(run, "rollout-0", "weights_refused")
    done = events(run, "controller-0", "training_done")[-1]
    assert done["steps"] == STEPS and done["unaccounted"] == 0
    assert [p for p in done["served"]] == ["rollout-0"]
