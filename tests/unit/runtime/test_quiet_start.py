"""Quiet by default: what every start does is not a warning on the launcher's console.

* A server a client has never heard from may simply not be up yet: its silence is still
  reported to `on_peer_lost` (a role's registration has its own timeout), but logged at
  info; a server that was heard from and then went silent is a warning.
* A garbage collection that is long on the wall clock only because the process was off
  the CPU (every role starting at once on a few cores) is info; one that spent its time
  collecting is a warning.
* The console shows the rollout's engine start as progress, and not `gc_frozen`.
"""

from __future__ import annotations

import asyncio
import gc
import io
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from rich.console import Console as RichConsole
from structlog.testing import capture_logs

from runtime import gc_pauses
from runtime.config.load import load_config
from runtime.views.console import Console
from transport import wire
from transport.endpoint import ChannelOptions, Envelope
from transport.sockets import bind_router, connect_dealer

FAST = ChannelOptions(heartbeat_s=0.05, peer_timeout_s=0.3, linger_s=0.0)
pytestmark = pytest.mark.timeout(60)


def console_text(tmp_path: Path, records: list[dict[str, Any]]) -> str:
    """What the launcher's console prints for these log records (not a terminal: plain lines)."""
    console = Console(tmp_path, load_config("configs/tiny_cpu.yaml", []))
    buf = io.StringIO()
    console.out = RichConsole(file=buf, highlight=False, soft_wrap=True, width=300)
    for rec in records:
        console.show(rec)
    return buf.getvalue()


def as_logged(entry: dict[str, Any], role: str) -> dict[str, Any]:
    """A captured structlog entry as the role's JSON log line carries it."""
    rest = {k: v for k, v in entry.items() if k != "log_level"}
    return {"level": entry["log_level"], "role": role, "rank": 0, **rest}


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def ack(env: Envelope) -> wire.Message | None:
    return wire.Ack()


async def test_a_server_not_yet_up_is_reported_but_only_a_heard_one_is_warned_of(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    address = f"ipc://{tmp_path}/controller"
    lost: list[float] = []
    with capture_logs() as logs:
        client = connect_dealer(ctx, address, name="controller", identity="reward-0", options=FAST)
        client.start(None, on_peer_lost=lambda _: lost.append(time.monotonic()))
        registering = asyncio.create_task(client.request(wire.Ack(), timeout=10))
        await asyncio.sleep(3 * FAST.peer_timeout_s)  # the controller is still starting
        assert len(lost) == 1, "the silence must still reach on_peer_lost"
        server = bind_router(ctx, address, name="server", options=FAST)
        server.start(ack)
        assert isinstance(await registering, wire.Ack)
        await asyncio.sleep(2 * FAST.peer_timeout_s)  # heard from: heartbeats keep it alive
        assert len(lost) == 1
        await server.aclose()  # now a real fault
        async with asyncio.timeout(5):
            while len(lost) < 2:
                await asyncio.sleep(0.02)
        await client.aclose()
    silent = [e for e in logs if e["event"] == "peer_silent"]
    assert [(e["log_level"], e["heard"]) for e in silent] == [("info", False), ("warning", True)]
    shown = console_text(tmp_path, [as_logged(e, "reward") for e in logs])
    assert shown.count("peer_silent") == 1 and "reward-0 warning peer_silent channel=controller" in shown


def test_a_collection_long_only_on_the_wall_clock_is_info(restore_gc: None) -> None:
    watcher = gc_pauses.watch(threshold_s=0.1, warn_cpu_s=0.1)

    def off_cpu(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            time.sleep(0.2)  # after the watcher's start: the OS ran something else meanwhile

    gc.callbacks.append(off_cpu)
    with capture_logs() as logs:
        gc.collect(0)
    gc.callbacks.remove(off_cpu)
    (pause,) = [e for e in logs if e["event"] == "gc_pause"]
    assert pause["log_level"] == "info" and pause["seconds"] >= 0.2 and pause["cpu_s"] < 0.1
    assert watcher.logged == 1 and watcher.warned == 0


def test_a_collection_that_spends_cpu_collecting_is_a_warning(restore_gc: None) -> None:
    # The automatic collector stays off until the test's own collection: one that ran between
    # `watch` and `capture_logs` would free the cycles (and warn) where the test cannot see it.
    gc.disable()
    garbage = []
    for i in range(300_000):  # cycles, so the collector has to walk and free them
        node: list[Any] = [i]
        node.append(node)
        garbage.append(node)
    del garbage, node
    watcher = gc_pauses.watch(threshold_s=0.0, warn_cpu_s=0.005)
    with capture_logs() as logs:
        gc.collect()
    (pause,) = [e for e in logs if e["event"] == "gc_pause"]
    assert pause["log_level"] == "warning" and pause["cpu_s"] >= 0.005 and pause["collected"] > 100_000
    assert watcher.warned == 1


def test_the_console_shows_engine_start_progress_and_not_gc_frozen(tmp_path: Path) -> None:
    shown = console_text(
        tmp_path,
        [
            {"level": "info", "event": "ready", "role": "controller", "rank": 0, "pid": 7, "gc_frozen": 362452},
            {"level": "info", "event": "engine_starting", "role": "rollout", "rank": 0, "model": "runs/x/model"},
            {"level": "info", "event": "engine_started", "role": "rollout", "rank": 0, "seconds": 14.2,
             "engine_core": "in-process", "device": {"kind": "cpu"}, "sleep_when_idle": False},
            {"level": "info", "event": "ready", "role": "rollout", "rank": 0, "version": 0, "gc_frozen": 628402},
        ],
    )  # fmt: skip
    assert shown.splitlines() == [
        "controller-0 ready",
        "rollout-0 starting vLLM engine (model runs/x/model)",
        "rollout-0 engine ready in 14.2 s",
        "rollout-0 ready version=0",
    ]
