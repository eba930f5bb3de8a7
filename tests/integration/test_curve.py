"""CurveZMQ on real sockets: the run's key gets through; a wrong key and a plaintext peer
are refused (and the refusal is logged), and the server keeps serving."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import zmq
import zmq.asyncio
from structlog.testing import capture_logs

from transport import wire
from transport.endpoint import ChannelOptions, Envelope
from transport.rpc import RequestTimeout
from transport.security import CurveKeys, generate_keys, load_keys, refused_count, start_authenticator
from transport.sockets import bind_router, connect_dealer


@pytest.fixture
def keys(tmp_path: Path) -> CurveKeys:
    return load_keys(generate_keys(tmp_path / "keys"))


@pytest_asyncio.fixture
async def server(keys: CurveKeys) -> AsyncIterator[tuple[zmq.asyncio.Context, str]]:
    ctx = zmq.asyncio.Context()
    auth = start_authenticator(ctx, keys)
    ep = bind_router(ctx, "tcp://127.0.0.1:0", name="curve-server", options=ChannelOptions(curve=keys))

    async def echo(env: Envelope) -> wire.Message | None:
        return env.msg

    ep.start(echo)
    yield ctx, ep.address
    await ep.aclose()
    auth.stop()
    ctx.destroy(linger=0)


async def ask(address: str, options: ChannelOptions, timeout: float = 1.5) -> wire.Message:
    ctx = zmq.asyncio.Context()
    client = connect_dealer(ctx, address, name="client", identity="client", options=options)
    client.start()
    try:
        return await client.request(wire.Ack(info="seven"), timeout=timeout)
    finally:
        await client.aclose()
        ctx.destroy(linger=0)


async def test_the_runs_key_is_accepted(server: tuple, keys: CurveKeys) -> None:
    reply = await ask(server[1], ChannelOptions(curve=keys))
    assert reply == wire.Ack(info="seven")


async def test_a_wrong_key_is_refused_and_logged(server: tuple, keys: CurveKeys, tmp_path: Path) -> None:
    other = load_keys(generate_keys(tmp_path / "other"))
    impostor = CurveKeys(public=other.public, secret=other.secret, server_public=keys.server_public)
    before = refused_count()
    with capture_logs() as logs, pytest.raises(RequestTimeout):
        await ask(server[1], ChannelOptions(curve=impostor))
    assert refused_count() > before
    assert any(e["event"] == "peer_refused" for e in logs)
    reply = await ask(server[1], ChannelOptions(curve=keys))  # still serving
    assert reply == wire.Ack(info="seven")


async def test_a_plaintext_peer_is_refused_and_logged(server: tuple, keys: CurveKeys) -> None:
    before = refused_count()
    with capture_logs() as logs, pytest.raises(RequestTimeout):
        await ask(server[1], ChannelOptions())
    assert refused_count() > before
    assert any(e["event"] == "peer_refused" and e["mechanism"] == "handshake" for e in logs)
    reply = await ask(server[1], ChannelOptions(curve=keys))
    assert reply == wire.Ack(info="seven")


async def test_missing_keys_are_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tandem keys"):
        load_keys(tmp_path / "nowhere")
    await asyncio.sleep(0)
