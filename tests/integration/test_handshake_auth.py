"""A peer without the run token never gets a frame into a server's
memory. Servers authenticate at the ZMQ handshake (PLAIN, the run token as password,
checked by ZAP), so a stranger's multipart message of frames each under the per-frame
cap (which libzmq would otherwise hold whole until its last frame) is never read; a
token holder's message over the per-message cap is dropped, counted, and the server
goes on serving. Attackers are other processes, so this process's memory is the
receiver's alone."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio
from structlog.testing import capture_logs

from runtime.identity.run_token import ensure_token
from transport import wire
from transport.endpoint import ChannelOptions, Envelope
from transport.rpc import RequestTimeout, RpcEndpoint
from transport.security import refused_count
from transport.sockets import bind_router, connect_dealer

ROOT = Path(__file__).resolve().parents[2]
CAP = 64 << 20

SENDER = """
import sys, time, zmq
from transport import wire
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
if sys.argv[2] != "-":
    sock.plain_username = b"tandem"
    sock.plain_password = sys.argv[2].encode()
sock.connect(sys.argv[1])
frame = bytes(int(int(sys.argv[3]) * 0.9))
header = wire.Header(wire.SCHEMA_VERSION, wire.MsgType.WEIGHT_BUCKET, 0, 0).pack()
sock.send_multipart([header, frame, frame, frame])
print("sent", flush=True)
time.sleep(30)
"""


@pytest_asyncio.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[RpcEndpoint, ChannelOptions]]:
    ctx = zmq.asyncio.Context()
    options = ChannelOptions(max_message_bytes=CAP, password=ensure_token(tmp_path))
    ep = bind_router(ctx, "tcp://127.0.0.1:0", name="server", options=options)

    async def echo(env: Envelope) -> wire.Message | None:
        return env.msg

    ep.start(echo)
    yield ep, options
    await ep.aclose()
    ctx.destroy(linger=0)


async def attack(address: str, password: str) -> int:
    """Peak growth of this process's RSS while another process sends 3 x 0.9 CAP frames."""
    proc = psutil.Process()
    base = peak = proc.memory_info().rss
    args = [sys.executable, "-c", SENDER, address, password, str(CAP)]
    sender = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert await asyncio.to_thread(sender.stdout.readline) == "sent\n"  # type: ignore[union-attr]
        for _ in range(15):  # 1.5 s: 170 MiB cross loopback in well under that
            await asyncio.sleep(0.1)
            peak = max(peak, proc.memory_info().rss)
    finally:
        sender.kill()
        sender.wait()
    return peak - base


async def ask(address: str, options: ChannelOptions) -> wire.Message:
    ctx = zmq.asyncio.Context()
    client = connect_dealer(ctx, address, name="client", identity="client", options=options)
    client.start()
    try:
        return await client.request(wire.Ack(info="seven"), timeout=5.0)
    finally:
        await client.aclose()
        ctx.destroy(linger=0)


async def test_a_peer_without_the_token_costs_the_server_nothing(server: tuple) -> None:
    ep, options = server
    before = refused_count()
    with capture_logs() as logs:
        grew = await attack(ep.address, "not-the-token")
    assert grew <= 1.1 * CAP, f"the receiver grew by {grew >> 20} MiB"
    assert ep.stats.received == 0 and ep.stats.bytes_received == 0 and not ep.stats.dropped
    assert refused_count() > before
    assert any(e["event"] == "peer_refused" and e["mechanism"] == "PLAIN" for e in logs)
    assert await ask(ep.address, options) == wire.Ack(info="seven")  # still serving


async def test_a_peer_without_any_credentials_is_refused(server: tuple) -> None:
    ep, options = server
    grew = await attack(ep.address, "-")
    assert grew <= 1.1 * CAP, f"the receiver grew by {grew >> 20} MiB"
    assert ep.stats.received == 0 and ep.stats.bytes_received == 0
    assert await ask(ep.address, options) == wire.Ack(info="seven")


async def test_a_token_holders_message_over_the_cap_is_dropped_and_counted(server: tuple) -> None:
    ep, options = server
    await attack(ep.address, options.password)
    assert ep.stats.dropped["oversized"] == 1 and ep.stats.received == 0
    assert await ask(ep.address, options) == wire.Ack(info="seven")


async def test_a_wrong_token_client_gets_no_reply(server: tuple) -> None:
    ep, _ = server
    wrong = ChannelOptions(max_message_bytes=CAP, password="0" * 64)
    ctx = zmq.asyncio.Context()
    client = connect_dealer(ctx, ep.address, name="client", identity="impostor", options=wrong)
    client.start()
    try:
        with pytest.raises(RequestTimeout):  # the server never saw the request
            await client.request(wire.Ack(info="seven"), timeout=1.0)
    finally:
        await client.aclose()
        ctx.destroy(linger=0)
    assert ep.stats.received == 0


def test_the_run_token_reaches_every_roles_channel_options(tmp_path: Path) -> None:
    """Every role builds its sockets from `channel_options`: it carries the run token."""
    from runtime.config import RunConfig
    from runtime.identity.addresses import channel_options

    assert channel_options(RunConfig(), tmp_path).password is None  # no token made yet
    token = ensure_token(tmp_path)
    assert channel_options(RunConfig(), tmp_path).password == token
