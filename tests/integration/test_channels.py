"""Channels over real sockets (ipc:// and tcp loopback), in this process and across processes.

What is checked: a server survives every kind of bad input and counts each drop once;
replies always match their requests under concurrency; timeouts, remote errors and
unroutable peers surface as their typed errors; heartbeats detect a peer that left,
whichever side it was.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio

from transport import wire
from transport.codec import Decoder, Encoder
from transport.endpoint import ChannelOptions, Envelope
from transport.rpc import PeerUnreachable, RemoteError, RequestTimeout, RpcEndpoint
from transport.sockets import bind_router, connect_dealer
from transport.wire import SCHEMA_VERSION, Header

ROOT = Path(__file__).resolve().parents[2]
FAST = ChannelOptions(heartbeat_s=0.05, peer_timeout_s=0.4, linger_s=0.0)
SMALL = ChannelOptions(max_message_bytes=4096)

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
]


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(params=["ipc", "tcp"])
def address(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/sock" if request.param == "ipc" else "tcp://127.0.0.1:0"


async def echo(env: Envelope) -> wire.Message | None:
    """A toy service over real messages. A `WeightBucket` comes back as it came. A
    `Generate` is answered with a `Completion` of its prompt whose request id starts with
    the caller's identity, after the op its request id names: `sleep:S`, `raise`,
    `unencodable`, `jitter` or `in_task`. Anything else gets an `Ack` naming its type."""
    msg = env.msg
    if isinstance(msg, wire.WeightBucket):
        return msg
    if not isinstance(msg, wire.Generate):
        return wire.Ack(info=type(msg).__name__)
    op, _, arg = msg.request_id.partition(":")
    if op == "sleep":
        await asyncio.sleep(float(arg))
    elif op == "raise":
        raise ValueError("boom")
    elif op == "unencodable":
        return wire.Ack(info=object())  # type: ignore[arg-type]
    elif op == "jitter":
        await asyncio.sleep(random.random() * 0.005)
    elif op == "in_task":
        # Before any await: asyncio.timeout (and 3.12's wait_for) need the handler's own task.
        async with asyncio.timeout(5):
            return wire.Ack(info=f"in a task: {asyncio.current_task() is not None}")
    n = len(msg.prompt_ids)
    return wire.Completion(
        request_id=f"{env.peer.decode() if env.peer else ''}/{msg.request_id}",
        group_id=msg.group_id,
        sample_index=0,
        token_ids=torch.tensor(msg.prompt_ids, dtype=torch.int64),
        logprobs=torch.zeros(n),
        versions=torch.zeros(n, dtype=torch.int32),
        finish_reason=wire.FinishReason.STOP,
    )


def ask(op: str = "echo", group_id: int = 0, prompt_ids: list[int] | None = None) -> wire.Generate:
    """A request for `echo`: `op` is the request id."""
    return wire.Generate(request_id=op, group_id=group_id, prompt_ids=prompt_ids or [group_id])


def bucket(version: int, **tensors: torch.Tensor) -> wire.WeightBucket:
    return wire.WeightBucket(version=version, index=0, last=True, tensors=tensors)


async def serve(ctx: zmq.asyncio.Context, address: str, options: ChannelOptions = ChannelOptions()) -> RpcEndpoint:
    server = bind_router(ctx, address, name="server", options=options)
    server.start(echo)
    return server


def client(
    ctx: zmq.asyncio.Context, address: str, identity: str, options: ChannelOptions = ChannelOptions()
) -> RpcEndpoint:
    ep = connect_dealer(ctx, address, name=identity, identity=identity, options=options)
    ep.start(None)
    return ep


# --- bad input -----------------------------------------------------------------------


class RawDealer:
    """A DEALER that sends whatever frames it is given: the misbehaving peer."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, identity: bytes = b"raw") -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(address)
        self.encoder, self.decoder = Encoder(), Decoder()

    async def send(self, frames: list[bytes]) -> None:
        await self.sock.send_multipart(frames)

    async def ask(self, msg: wire.Message, corr: int, timeout: float = 5.0) -> wire.Message:
        """A well-formed request; returns its reply, skipping heartbeats and late replies."""
        await self.sock.send_multipart(self.encoder.encode(msg, corr=corr))
        async with asyncio.timeout(timeout):
            while True:
                header, reply = self.decoder.decode(await self.sock.recv_multipart())
                if header.flags & wire.Flag.REPLY and header.corr == corr:
                    return reply


def bad_messages() -> dict[str, list[bytes]]:
    """One message per drop reason, for a server with max_message_bytes=4096."""
    enc = Encoder()
    good = [bytes(np.asarray(f)) for f in enc.encode(bucket(0, t=torch.zeros(100)))]
    # Three 1.6 KB tensor frames: each under the socket's per-frame limit, 4.8 KB in all.
    big = [
        bytes(np.asarray(f)) for f in enc.encode(bucket(0, a=torch.zeros(400), b=torch.zeros(400), c=torch.zeros(400)))
    ]
    return {
        "bad_header": [b"\x01\x02\x03", *good[1:]],
        "schema_version": [Header(SCHEMA_VERSION + 1, wire.MsgType.WEIGHT_BUCKET, 0, 0).pack(), *good[1:]],
        "unknown_type": [Header(SCHEMA_VERSION, 200, 0, 0).pack(), *good[1:]],
        "malformed": [good[0], b"\xc1 this is not msgpack"],
        "truncated": good[:2],  # the tensor's frame is missing
        "oversized": big,  # above the 4 KiB cap in all, every frame below the socket's per-frame limit
    }


async def ask_until_answered(raw: RawDealer, msg: wire.Message, corr: int, tries: int = 10) -> wire.Message:
    for _ in range(tries - 1):
        try:
            return await raw.ask(msg, corr=corr, timeout=0.5)
        except TimeoutError:
            continue
    return await raw.ask(msg, corr=corr)


async def check_survives_bad_input(raw: RawDealer, dropped: Any) -> None:
    """Every bad message is followed by a good request that must still be answered."""
    before = Counter(await dropped())
    corr = 1
    for reason, frames in bad_messages().items():
        await raw.send(frames)
        x = torch.arange(float(corr))
        if reason == "oversized":
            # The server cuts the connection of a peer whose message grows past the cap
            # (transport/zmtp_router.py): what it sent next is lost, its DEALER reconnects.
            reply = await ask_until_answered(raw, bucket(corr, x=x), corr)
        else:
            reply = await raw.ask(bucket(corr, x=x), corr=corr)
        assert isinstance(reply, wire.WeightBucket) and reply.version == corr and torch.equal(reply.tensors["x"], x)
        corr += 1
    counts = Counter(await dropped())
    counts.subtract(before)
    assert +counts == Counter(dict.fromkeys(bad_messages(), 1))


async def test_server_drops_each_bad_message_once_and_keeps_serving(ctx: zmq.asyncio.Context, address: str) -> None:
    server = await serve(ctx, address, SMALL)
    raw = RawDealer(ctx, server.address)

    async def dropped() -> dict[str, int]:
        return dict(server.stats.dropped)

    await check_survives_bad_input(raw, dropped)
    assert server.stats.received >= len(bad_messages())
    await server.aclose()


async def test_a_flood_of_bad_messages_costs_a_few_log_lines(ctx: zmq.asyncio.Context, address: str) -> None:
    """10k malformed messages from two peers: every one counted, a handful logged one by
    one per peer and reason, the rest in summaries; the server keeps serving."""
    from structlog.testing import capture_logs

    server = await serve(ctx, address, SMALL)
    peers = [RawDealer(ctx, server.address, identity=f"raw-{i}".encode()) for i in range(2)]
    bad = bad_messages()["malformed"]
    with capture_logs() as logs:
        for i in range(10_000):
            await peers[i % 2].send(bad)
        for i, peer in enumerate(peers):  # each peer's messages arrive in order: all 10k are in
            reply = await peer.ask(bucket(7 + i, x=torch.ones(3)), corr=7 + i)
            assert isinstance(reply, wire.WeightBucket) and reply.version == 7 + i
        await server.aclose()
    assert server.stats.dropped["malformed"] == 10_000
    one_by_one = [e for e in logs if e["event"] == "message_dropped"]
    summaries = [e for e in logs if e["event"] == "messages_dropped"]
    assert len(one_by_one) == 5  # DROP_LOG_PER_REASON over both peers (DROP_LOG_FIRST each)
    assert {e["peer"] for e in one_by_one} == {"raw-0", "raw-1"}
    assert 1 <= len(summaries) <= 5 and len(one_by_one) + len(summaries) < 30
    assert len(one_by_one) + sum(e["unlogged"] for e in summaries) == 10_000
    assert summaries[-1]["total"] == {"malformed": 10_000}


async def test_a_flood_from_thousands_of_peers_costs_a_few_log_lines(ctx: zmq.asyncio.Context) -> None:
    """5,000 malformed frames from 5,000 identities once printed 1,020 lines (3 per peer,
    up to the peers remembered) and left ~3,980 drops in no summary. Now a few one by one,
    summaries (also once the flood has stopped: the heartbeat's tick) count every one."""
    from structlog.testing import capture_logs

    server = await serve(ctx, "tcp://127.0.0.1:0", ChannelOptions(max_message_bytes=4096, heartbeat_s=0.1))
    bad = bad_messages()["malformed"]
    with capture_logs() as logs:
        for start in range(0, 5_000, 500):  # 500 sockets open at a time
            peers = [RawDealer(ctx, server.address, identity=f"p-{i}".encode()) for i in range(start, start + 500)]
            for peer in peers:
                await peer.send(bad)
            async with asyncio.timeout(20):
                while server.stats.dropped["malformed"] < start + 500:
                    await asyncio.sleep(0.01)
            for peer in peers:
                peer.sock.close(linger=0)
        await server.aclose()  # its last summary: the rest since the last (the heartbeat's come every 10 s)
    summed = [e for e in logs if e["event"] == "messages_dropped"]
    one_by_one = [e for e in logs if e["event"] == "message_dropped"]
    assert len(one_by_one) == 5 and len(one_by_one) + len(summed) <= 50
    assert len(one_by_one) + sum(e["unlogged"] for e in summed) == 5_000
    assert summed[-1]["total"] == {"malformed": 5_000} and max(e["peers"] for e in summed) > 1


def test_drop_summaries_come_at_most_every_period() -> None:
    from structlog.testing import capture_logs

    from transport.endpoint import DROP_SUMMARY_S, DropLog

    now = [0.0]
    drops = DropLog("c", clock=lambda: now[0])
    with capture_logs() as logs:
        for _ in range(100):
            drops.dropped("p", "malformed", "x")
            now[0] += DROP_SUMMARY_S / 20  # 5 periods in all
        drops.summary()
    summaries = [e for e in logs if e["event"] == "messages_dropped"]
    assert 4 <= len(summaries) <= 6 and sum(e["unlogged"] for e in summaries) == 97


def test_a_flood_that_stopped_is_summed_up_at_the_next_tick() -> None:
    from structlog.testing import capture_logs

    from transport.endpoint import DROP_SUMMARY_S, DropLog

    now = [0.0]
    drops = DropLog("c", clock=lambda: now[0])
    with capture_logs() as logs:
        for i in range(50):
            drops.dropped(f"p{i}", "malformed", "x")
        drops.tick()
        assert not [e for e in logs if e["event"] == "messages_dropped"]
        now[0] += DROP_SUMMARY_S
        drops.tick()  # no drop since: the heartbeat's tick says it
    (summary,) = [e for e in logs if e["event"] == "messages_dropped"]
    assert summary["unlogged"] == 45 and summary["peers"] == 45 and summary["total"] == {"malformed": 50}


def test_the_one_by_one_budget_renews_every_window() -> None:
    from structlog.testing import capture_logs

    from transport.endpoint import DROP_WINDOW_S, DropLog

    now = [0.0]
    drops = DropLog("c", clock=lambda: now[0])
    with capture_logs() as logs:
        for minute in range(3):
            now[0] = minute * DROP_WINDOW_S
            for i in range(100):
                drops.dropped(f"p{i}", "malformed", "x")
    assert len([e for e in logs if e["event"] == "message_dropped"]) == 3 * 5  # a few a minute, however many peers


OVERSIZED_SENDER = """
import sys, time, zmq
from transport import wire
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(sys.argv[1])
frame = bytes(96 << 20)
sock.send_multipart([wire.Header(wire.SCHEMA_VERSION, wire.MsgType.WEIGHT_BUCKET, 0, 0).pack(), frame, frame])
print("sent", flush=True)
time.sleep(30)
"""


async def test_an_oversized_frame_never_costs_the_receiver_its_size(ctx: zmq.asyncio.Context) -> None:
    """Two 96 MiB frames to a server capped at 32 MiB used to be read
    whole (the socket allowed 4x the cap per frame) before the drop. Now the socket cuts the
    connection at the first frame's length: the server's memory does not grow by the cap.
    The sender is another process, so this process's memory is the receiver's alone."""
    import psutil

    cap = 32 << 20
    server = await serve(ctx, "tcp://127.0.0.1:0", ChannelOptions(max_message_bytes=cap))
    rss = psutil.Process().memory_info().rss
    args = [sys.executable, "-c", OVERSIZED_SENDER, server.address]
    sender = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert await asyncio.to_thread(sender.stdout.readline) == "sent\n"  # type: ignore[union-attr]
        await asyncio.sleep(1.0)
        grew = psutil.Process().memory_info().rss - rss
    finally:
        sender.kill()
        sender.wait()
    assert grew < cap, f"the receiver grew by {grew >> 20} MiB"
    await server.aclose()


async def test_frame_over_the_socket_cap_costs_one_connection_not_the_server(ctx: zmq.asyncio.Context) -> None:
    """zmq cuts a peer sending a frame over max_message_bytes; the server serves the reconnection."""
    server = await serve(ctx, "tcp://127.0.0.1:0", SMALL)
    raw = RawDealer(ctx, server.address)
    huge = [Header(SCHEMA_VERSION, wire.MsgType.WEIGHT_BUCKET, 0, 0).pack(), b"\0" * (4096 + 1)]
    await raw.send(huge)
    for corr in range(1, 50):  # messages in flight while the connection drops are lost
        try:
            reply = await raw.ask(bucket(corr), corr=corr, timeout=0.2)
            break
        except TimeoutError:
            continue
    else:
        pytest.fail("the server never answered again")
    assert isinstance(reply, wire.WeightBucket) and reply.version == corr
    await server.aclose()


# --- request / reply ------------------------------------------------------------------


async def many_requests(clients: list[RpcEndpoint], per_client: int) -> None:
    async def one(i: int, k: int) -> None:
        seq = i * 1000 + k
        if k % 2:  # tensors out and back: small ones inline, larger ones as frames
            x = torch.full((k * 20 + 1,), float(seq))
            reply = await clients[i].request(bucket(seq, x=x), timeout=20)
            assert isinstance(reply, wire.WeightBucket) and reply.version == seq and torch.equal(reply.tensors["x"], x)
            return
        prompt = list(range(seq, seq + k * 20 + 1))
        reply = await clients[i].request(ask("jitter", seq, prompt), timeout=20)
        assert isinstance(reply, wire.Completion) and reply.group_id == seq
        assert reply.request_id == f"client-{i}/jitter" and reply.token_ids.tolist() == prompt

    await asyncio.gather(*(one(i, k) for i in range(len(clients)) for k in range(per_client)))


async def test_concurrent_requests_get_their_own_replies(ctx: zmq.asyncio.Context, address: str) -> None:
    server = await serve(ctx, address)
    clients = [client(ctx, server.address, f"client-{i}") for i in range(4)]
    await many_requests(clients, per_client=50)
    assert server.stats.dropped == Counter() and all(c.stats.dropped == Counter() for c in clients)
    for ep in [*clients, server]:
        await ep.aclose()


async def test_timeout_then_late_reply_is_dropped_harmlessly(ctx: zmq.asyncio.Context, address: str) -> None:
    server = await serve(ctx, address)
    c = client(ctx, server.address, "impatient")
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout):
        await c.request(ask("sleep:0.4"), timeout=0.1)
    assert time.monotonic() - t0 < 0.35
    async with asyncio.timeout(3):  # the reply arrives after the caller gave up
        while not c.stats.dropped["late_reply"]:
            await asyncio.sleep(0.02)
    reply = await c.request(ask(group_id=2), timeout=2)
    assert isinstance(reply, wire.Completion) and reply.group_id == 2
    assert c.stats.dropped == Counter(late_reply=1)
    await c.aclose()
    await server.aclose()


async def test_handlers_run_inside_their_own_task(ctx: zmq.asyncio.Context, address: str) -> None:
    """A handler that uses asyncio.timeout before its first await works (it broke weight
    sync on Python 3.12 while handlers were stepped by hand outside any task)."""
    server = await serve(ctx, address)
    c = client(ctx, server.address, "caller")
    replies = await asyncio.gather(*(c.request(ask("in_task", i), timeout=2) for i in range(8)))
    assert replies == [wire.Ack(info="in a task: True")] * 8
    assert server.stats.dropped == Counter()
    await c.aclose()
    await server.aclose()


async def test_handler_errors_become_remote_errors(ctx: zmq.asyncio.Context, address: str) -> None:
    server = await serve(ctx, address)
    c = client(ctx, server.address, "caller")
    with pytest.raises(RemoteError) as info:
        await c.request(ask("raise"), timeout=2)
    assert info.value.code == wire.ErrorCode.INTERNAL and "boom" in info.value.message
    # A reply that cannot be encoded is an error too, not a silent timeout.
    with pytest.raises(RemoteError) as info:
        await c.request(ask("unencodable"), timeout=2)
    assert "TypeError" in info.value.message
    reply = await c.request(wire.Shutdown(reason="x"), timeout=2)
    assert reply == wire.Ack(info="Shutdown")
    await c.aclose()
    await server.aclose()


async def test_receive_path_outlives_a_socket_error(ctx: zmq.asyncio.Context) -> None:
    server = bind_router(ctx, "tcp://127.0.0.1:0", name="server")
    real_recv = server.sock.recv_multipart
    failures = [zmq.ZMQError(errno.EINTR)]

    def flaky_recv(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return real_recv(*args, **kwargs)

    server.sock.recv_multipart = flaky_recv  # type: ignore[method-assign]
    server.start(echo)
    c = client(ctx, server.address, "caller")
    reply = await c.request(ask(group_id=5), timeout=2)
    assert isinstance(reply, wire.Completion) and reply.group_id == 5 and not failures
    await c.aclose()
    await server.aclose()


async def test_router_send_to_unknown_peer_raises(ctx: zmq.asyncio.Context, address: str) -> None:
    server = await serve(ctx, address)
    with pytest.raises(PeerUnreachable):
        await server.send(wire.Ack(), peer=b"nobody")
    t0 = time.monotonic()
    with pytest.raises(PeerUnreachable):
        await server.request(wire.Ack(), peer=b"nobody", timeout=5)
    assert time.monotonic() - t0 < 1
    with pytest.raises(ValueError):
        await server.send(wire.Ack())
    await server.aclose()


async def test_server_requests_a_known_client(ctx: zmq.asyncio.Context, address: str) -> None:
    """Requests flow the other way too: the ROUTER asks a DEALER that registered."""
    server = await serve(ctx, address)
    c = connect_dealer(ctx, server.address, name="worker", identity="worker")

    async def work(env: Envelope) -> wire.Message:
        assert isinstance(env.msg, wire.WeightBucket)
        return bucket(env.msg.version + 1, y=env.msg.tensors["x"] * 2)

    c.start(work)
    await c.request(wire.Ack(), timeout=2)  # the server now knows "worker"
    x = torch.randn(1000)
    reply = await server.request(bucket(7, x=x), peer=b"worker", timeout=2)
    assert isinstance(reply, wire.WeightBucket) and reply.version == 8 and torch.equal(reply.tensors["y"], x * 2)
    await c.aclose()
    await server.aclose()


# --- heartbeats and peer loss -----------------------------------------------------------


class LostPeers:
    """An on_peer_lost callback that records who was lost and when."""

    def __init__(self, fail_first: bool = False) -> None:
        self.events: list[tuple[bytes | None, float]] = []
        self.fail_first = fail_first
        self.changed = asyncio.Event()

    def __call__(self, peer: bytes | None) -> None:
        self.events.append((peer, time.monotonic()))
        self.changed.set()
        if self.fail_first and len(self.events) == 1:
            raise RuntimeError("callback bug: must not stop the heartbeat loop")

    async def wait(self, count: int, timeout: float = 3.0) -> None:
        async with asyncio.timeout(timeout):
            while len(self.events) < count:
                self.changed.clear()
                await self.changed.wait()


# Detection happens on a heartbeat tick after peer_timeout_s; allow a scheduling margin.
DETECT_WITHIN = FAST.peer_timeout_s + 2 * FAST.heartbeat_s + 0.5


async def test_server_reports_a_client_that_stops(ctx: zmq.asyncio.Context, address: str) -> None:
    lost = LostPeers(fail_first=True)
    server = bind_router(ctx, address, name="server", options=FAST)
    server.start(echo, on_peer_lost=lost)
    first = client(ctx, server.address, "first", FAST)
    second = client(ctx, server.address, "second", FAST)
    await first.request(wire.Ack(), timeout=2)
    await second.request(wire.Ack(), timeout=2)
    await asyncio.sleep(2 * FAST.peer_timeout_s)  # heartbeats alone keep both alive
    assert lost.events == []

    stopped = time.monotonic()
    await first.aclose()
    await lost.wait(1)
    assert lost.events[0][0] == b"first" and lost.events[0][1] - stopped < DETECT_WITHIN
    stopped = time.monotonic()  # the callback raised: detection must go on regardless
    await second.aclose()
    await lost.wait(2)
    assert lost.events[1][0] == b"second" and lost.events[1][1] - stopped < DETECT_WITHIN

    # A peer that comes back is watched again: its next silence is reported too.
    back = client(ctx, server.address, "first", FAST)
    await back.request(wire.Ack(), timeout=2)
    stopped = time.monotonic()
    await back.aclose()
    await lost.wait(3)
    assert lost.events[2][0] == b"first" and lost.events[2][1] - stopped < DETECT_WITHIN
    await server.aclose()


async def test_client_reports_a_server_that_stops(ctx: zmq.asyncio.Context, address: str) -> None:
    server = await serve(ctx, address, FAST)
    lost = LostPeers()
    c = connect_dealer(ctx, server.address, name="c", identity="c", options=FAST)
    c.start(None, on_peer_lost=lost)
    await c.request(wire.Ack(), timeout=2)
    await asyncio.sleep(2 * FAST.peer_timeout_s)
    assert lost.events == []
    stopped = time.monotonic()
    await server.aclose()
    await lost.wait(1)
    assert lost.events[0][0] is None and lost.events[0][1] - stopped < DETECT_WITHIN
    await c.aclose()


async def test_full_send_queue_blocks_neither_liveness_nor_timeouts(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """A DEALER whose server never came: sends block at the high-water mark, yet the
    loss is reported and a request still times out on time."""
    options = ChannelOptions(hwm=1, heartbeat_s=0.05, peer_timeout_s=0.3)
    lost = LostPeers()
    c = connect_dealer(ctx, f"ipc://{tmp_path}/nobody", name="c", identity="c", options=options)
    c.start(None, on_peer_lost=lost)
    for _ in range(3):
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout):
            await c.request(wire.Ack(), timeout=0.1)
        assert time.monotonic() - t0 < 0.6
    await lost.wait(1)
    assert lost.events[0][0] is None
    await c.aclose()


async def test_a_send_to_a_peer_that_never_reads_fails_after_send_timeout(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """A live peer that stops reading used to hold the sender forever (the
    controller's dispatch, unnoticed). Now the send gives up after send_timeout_s, naming it."""
    options = ChannelOptions(hwm=2, send_timeout_s=0.5)
    server = bind_router(ctx, f"ipc://{tmp_path}/s", name="server", options=options)
    server.start(echo)
    raw = RawDealer(ctx, server.address)
    raw.sock.setsockopt(zmq.RCVHWM, 2)
    assert isinstance(await raw.ask(wire.Ack(), corr=1), wire.Ack)
    mib = torch.zeros(1 << 18)
    started = time.monotonic()
    with pytest.raises(PeerUnreachable, match=r"peer raw took no message for 0\.5s .*stopped reading"):
        for i in range(64):
            await server.send(bucket(i, x=mib), peer=b"raw")
    assert time.monotonic() - started < 5.0
    raw.sock.close(linger=0)
    await server.aclose()


async def test_router_send_to_a_peer_that_does_not_read_waits_for_it(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """With the peer's queue full a ROUTER send waits (the socket stays writable toward
    other peers, so it polls with a backoff) and completes, in order, once the peer reads."""
    server = bind_router(ctx, f"ipc://{tmp_path}/s", name="server", options=ChannelOptions(hwm=2))
    server.start(echo)
    raw = RawDealer(ctx, server.address)
    raw.sock.setsockopt(zmq.RCVHWM, 2)
    assert isinstance(await raw.ask(wire.Ack(), corr=1), wire.Ack)  # known to the server
    mib = torch.zeros(1 << 18)  # 1 MiB: 32 of them fill the queues and the kernel's socket buffers

    async def send_all() -> None:
        for i in range(32):
            await server.send(bucket(i, x=mib), peer=b"raw")

    sends = asyncio.ensure_future(send_all())
    try:
        await asyncio.sleep(0.3)
        assert not sends.done(), "32 MiB cannot be queued toward a peer that does not read"
        seqs = []
        async with asyncio.timeout(10):
            while len(seqs) < 32:
                _, msg = raw.decoder.decode(await raw.sock.recv_multipart())
                if isinstance(msg, wire.WeightBucket):
                    seqs.append(msg.version)
            await sends
        assert seqs == list(range(32))
    finally:
        sends.cancel()
        raw.sock.close(linger=0)
        await server.aclose()


# --- across processes -------------------------------------------------------------------

SERVER_SCRIPT = r"""
import asyncio, json, sys
import structlog
from transport import wire
from transport.endpoint import ChannelOptions
from transport.sockets import bind_router
import zmq.asyncio

structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
from tests.integration.test_channels import echo  # the same toy service as in-process

async def main(address, max_bytes):
    server = bind_router(
        zmq.asyncio.Context(), address, name="remote",
        options=ChannelOptions(max_message_bytes=max_bytes, heartbeat_s=0.05, peer_timeout_s=1.0),
    )

    async def handle(env):
        if isinstance(env.msg, wire.Generate) and env.msg.request_id == "stats":
            return wire.Ack(info=json.dumps(server.stats.dropped))
        return await echo(env)

    server.start(handle)
    print("READY", server.address, flush=True)
    await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def start_server(address: str, log: Path, max_bytes: int = 1 << 30) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-c", SERVER_SCRIPT, address, str(max_bytes)]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the server is bound (or died)
    if not line.startswith("READY"):
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}\n{log.read_text()}")
    return proc, line.split()[1]


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server in another process (tcp), shared by the tests of this module."""
    proc, address = start_server("tcp://127.0.0.1:0", tmp_path_factory.mktemp("remote") / "log", max_bytes=4096)
    yield address
    proc.kill()
    proc.wait()


async def test_remote_server_survives_bad_input(ctx: zmq.asyncio.Context, remote: str) -> None:
    raw = RawDealer(ctx, remote)
    stats_corr = iter(range(10_000, 20_000))

    async def dropped() -> dict[str, int]:
        reply = await raw.ask(ask("stats"), corr=next(stats_corr))
        assert isinstance(reply, wire.Ack)
        return json.loads(reply.info)

    await check_survives_bad_input(raw, dropped)


async def test_remote_server_answers_concurrent_clients(ctx: zmq.asyncio.Context, remote: str) -> None:
    clients = [client(ctx, remote, f"client-{i}") for i in range(4)]
    await many_requests(clients, per_client=50)
    for c in clients:
        await c.aclose()


async def test_client_reports_a_server_process_that_dies(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    proc, address = start_server(f"ipc://{tmp_path}/srv", tmp_path / "log")
    try:
        lost = LostPeers()
        c = connect_dealer(ctx, address, name="c", identity="c", options=FAST)
        c.start(None, on_peer_lost=lost)
        x = torch.randn(128, 1024)
        reply = await c.request(bucket(3, x=x), timeout=5)
        assert isinstance(reply, wire.WeightBucket) and torch.equal(reply.tensors["x"], x)
        killed = time.monotonic()
        proc.kill()
        await lost.wait(1)
        assert lost.events == [(None, lost.events[0][1])] and lost.events[0][1] - killed < DETECT_WITHIN
        with pytest.raises(RequestTimeout):
            await c.request(wire.Ack(), timeout=0.2)
        await c.aclose()
    finally:
        proc.kill()
        proc.wait()
