"""The ZMTP router (transport/zmtp_router.py) against libzmq DEALERs, server in another process.

A token holder's message over the cap is cut before it costs the server more than the
cap (frames of 60 MB, or 100 000 empty frames), wrong tokens and duplicate identities
are refused and logged, what is within the cap arrives byte-exact, and a peer with ZMTP
heartbeats on gets its PONGs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio

from runtime.identity.run_token import ensure_token
from transport import wire
from transport.codec import Encoder
from transport.endpoint import ChannelOptions
from transport.sockets import connect_dealer

ROOT = Path(__file__).resolve().parents[2]
CAP = 64 << 20

SERVER = r"""
import asyncio, json, sys
import structlog, zmq.asyncio
from transport import wire
from transport.endpoint import ChannelOptions
from transport.security import refused_count
from transport.sockets import bind_router

structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))

async def main(cap, password):
    opts = ChannelOptions(max_message_bytes=cap, password=password)
    ep = bind_router(zmq.asyncio.Context(), "tcp://127.0.0.1:0", name="server", options=opts)

    async def handle(env):
        if isinstance(env.msg, wire.Ack) and env.msg.info == "stats":
            st = {"dropped": dict(ep.stats.dropped), "received": ep.stats.received, "refused": refused_count()}
            return wire.Ack(info=json.dumps(st))
        return env.msg  # an echo

    ep.start(handle)
    print("READY", ep.address, flush=True)
    await asyncio.Event().wait()

asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
"""


class Server:
    def __init__(self, proc: subprocess.Popen[str], address: str, token: str, log: Path) -> None:
        self.proc, self.address, self.token, self.log = proc, address, token, log

    def status_kib(self, field: str) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise KeyError(field)

    def reset_peak(self) -> int:
        """Make VmHWM the current RSS (clear_refs 5); returns that RSS in bytes."""
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")
        return self.status_kib("VmRSS") << 10


@pytest.fixture
def server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Server]:
    cap = getattr(request, "param", CAP)
    token = ensure_token(tmp_path)
    log = tmp_path / "server.log"
    args = [sys.executable, "-c", SERVER, str(cap), token]
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY"), log.read_text()
    yield Server(proc, line.split()[1], token, log)
    proc.kill()
    proc.wait()


def raw_dealer(ctx: zmq.Context[Any], server: Server, identity: bytes, token: str | None = None) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.plain_username = b"tandem"
    sock.plain_password = (token or server.token).encode()
    sock.connect(server.address)
    return sock


def ask(sock: zmq.Socket[Any], msg: wire.Message, corr: int, timeout_s: float = 10.0) -> wire.Message | None:
    """Send `msg` as a request on a raw DEALER; its reply, or None after `timeout_s`."""
    from transport.codec import Decoder

    sock.send_multipart(Encoder().encode(msg, corr=corr))
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000)):
            break
        header, reply = Decoder().decode(sock.recv_multipart())
        if header.flags & wire.Flag.REPLY and header.corr == corr:
            return reply
    return None


def stats(server: Server, identity: bytes = b"observer") -> dict[str, Any]:
    """The server's counters, asked by a well-behaved peer."""
    ctx = zmq.Context()
    try:
        reply = ask(raw_dealer(ctx, server, identity), wire.Ack(info="stats"), corr=1)
        assert isinstance(reply, wire.Ack), "a well-behaved peer got no answer"
        return dict(json.loads(reply.info))
    finally:
        ctx.destroy(linger=0)


def header() -> bytes:
    return wire.Header(wire.SCHEMA_VERSION, wire.MsgType.WEIGHT_BUCKET, 0, 0).pack()


def send_and_wait_for_drop(server: Server, frames: list[Any]) -> dict[str, Any]:
    """Send `frames` as one message from a token holder; the server's stats once it dropped it."""
    before = stats(server)["dropped"].get("oversized", 0)
    ctx = zmq.Context()
    try:
        sock = raw_dealer(ctx, server, b"attacker")
        sock.send_multipart(frames, copy=False)
        for _ in range(200):
            after = stats(server)
            if after["dropped"].get("oversized", 0) > before:
                return after
            time.sleep(0.05)
    finally:
        ctx.destroy(linger=0)
    raise AssertionError(f"no oversized drop counted: {after}")


def test_three_60mb_frames_cost_the_server_at_most_its_cap(server: Server) -> None:
    stats(server)  # warm: the codec's first decode
    base = server.reset_peak()
    frame = bytes(60_000_000)
    after = send_and_wait_for_drop(server, [header(), frame, frame, frame])
    grew = (server.status_kib("VmHWM") << 10) - base
    assert grew <= 1.1 * CAP, f"the server grew by {grew >> 20} MiB"
    assert after["dropped"] == {"oversized": 1} and after["received"] >= 1
    assert "message_dropped" in server.log.read_text() and "oversized" in server.log.read_text()
    assert stats(server, b"second")["dropped"] == {"oversized": 1}  # still serving a new peer


def test_a_hundred_thousand_empty_frames_are_cut(server: Server) -> None:
    stats(server)
    base = server.reset_peak()
    after = send_and_wait_for_drop(server, [header(), *([b""] * 100_000)])
    grew = (server.status_kib("VmHWM") << 10) - base
    assert grew <= 1.1 * CAP, f"the server grew by {grew >> 20} MiB"
    assert after["dropped"] == {"oversized": 1}


def test_a_wrong_token_is_refused_and_logged(server: Server) -> None:
    refused = stats(server)["refused"]
    ctx = zmq.Context()
    try:
        impostor = raw_dealer(ctx, server, b"impostor", token="0" * 64)
        assert ask(impostor, wire.Ack(info="stats"), corr=1, timeout_s=1.0) is None
    finally:
        ctx.destroy(linger=0)
    after = stats(server)
    assert after["refused"] > refused and after["received"] == 2  # the two stats requests only
    log = server.log.read_text()
    assert "peer_refused" in log and "wrong or missing run token" in log


def test_a_duplicate_identity_is_refused_while_the_first_peer_keeps_working(server: Server) -> None:
    ctx = zmq.Context()
    try:
        first = raw_dealer(ctx, server, b"twin")
        assert ask(first, wire.Ack(info="one"), corr=1) == wire.Ack(info="one")
        refused = stats(server)["refused"]
        second = raw_dealer(ctx, server, b"twin")
        assert ask(second, wire.Ack(info="two"), corr=2, timeout_s=1.0) is None
        assert ask(first, wire.Ack(info="three"), corr=3) == wire.Ack(info="three")
    finally:
        ctx.destroy(linger=0)
    assert stats(server)["refused"] > refused
    assert "identity in use by a live peer" in server.log.read_text()


def test_a_heartbeating_peer_gets_its_pongs_and_stays_connected(server: Server) -> None:
    """A libzmq DEALER with ZMTP heartbeats (PING every 100 ms, dropping the connection after
    1 s without any answer) stays on its one connection through 2.5 s of silence: the router
    answers each PING with a PONG. Without PONGs it disconnects and reconnects within 2.5 s."""
    from zmq.utils.monitor import recv_monitor_message

    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, b"heart")
        sock.setsockopt(zmq.HEARTBEAT_IVL, 100)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 1000)
        sock.plain_username, sock.plain_password = b"tandem", server.token.encode()
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(server.address)
        assert ask(sock, wire.Ack(info="before"), corr=1) == wire.Ack(info="before")
        time.sleep(2.5)
        assert ask(sock, wire.Ack(info="after"), corr=2) == wire.Ack(info="after")
        events = []
        while monitor.poll(100):
            events.append(recv_monitor_message(monitor)["event"])
        assert events == [zmq.EVENT_HANDSHAKE_SUCCEEDED], events
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("server", [1 << 30], indirect=True)
async def test_large_and_many_small_messages_arrive_byte_exact(server: Server) -> None:
    ctx = zmq.asyncio.Context()
    opts = ChannelOptions(max_message_bytes=1 << 30, password=server.token)
    client = connect_dealer(ctx, server.address, name="client", identity="client", options=opts)
    client.start()
    try:
        big = torch.randint(0, 256, (200_000_000,), dtype=torch.uint8)
        reply = await client.request(bucket(1, big=big), timeout=60.0)
        assert isinstance(reply, wire.WeightBucket) and torch.equal(reply.tensors["big"], big)
        small = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in range(0, 3000, 3)]
        for i, t in enumerate(small):
            reply = await client.request(bucket(i, t=t), timeout=10.0)
            assert isinstance(reply, wire.WeightBucket) and reply.version == i and torch.equal(reply.tensors["t"], t)
    finally:
        await client.aclose()
        ctx.destroy(linger=0)


def bucket(version: int, **tensors: torch.Tensor) -> wire.WeightBucket:
    return wire.WeightBucket(version=version, index=0, last=True, tensors=tensors)
