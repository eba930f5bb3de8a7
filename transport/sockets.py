"""The sockets endpoints use, with the policy of `ChannelOptions` applied.

Every socket has explicit high-water marks, a linger bound and a hard per-frame size
limit of `max_message_bytes` (ZMQ_MAXMSGSIZE): libzmq reads a frame's length first and
drops the connection of a peer that sends a larger one, so such a frame never costs the
receiver its size in memory (a message of several frames, each under the cap, still can:
libzmq has no limit on the number of frames; `Endpoint.admit` then drops and counts it).
Only a peer that passed the handshake can send a frame at all: with `options.curve` the
peer needs the run's Curve key, otherwise, with `options.password` (the run token), it
must present that token (ZMQ PLAIN, checked by the context's ZAP handler, which
`bind_router` starts when none runs yet), so a stranger's frames never reach memory.
A ROUTER routes mandatorily, so a send to an unknown peer is an error (`PeerUnreachable`)
rather than a silent loss, and it refuses a newcomer with a live peer's identity.
"""

from __future__ import annotations

import zmq
import zmq.asyncio

from transport.endpoint import ChannelOptions
from transport.rpc import RpcEndpoint
from transport.security import PLAIN_USER, ZAP_DOMAIN, apply_curve, ensure_authenticator


def bind_router(
    ctx: zmq.asyncio.Context,
    address: str,
    *,
    name: str,
    options: ChannelOptions = ChannelOptions(),
    listen_fd: int | None = None,
) -> RpcEndpoint:
    """A ROUTER bound at `address` (tcp port 0 or `*` picks a free port; see `.address`).
    With `listen_fd`, a TCP socket already bound to `address`'s port and listening (as the
    launcher hands one over, runtime.launch.rendezvous), the ROUTER serves on it (ZMQ_USE_FD)
    and owns it from then on."""
    sock = ctx.socket(zmq.ROUTER)
    if listen_fd is not None:
        sock.setsockopt(zmq.USE_FD, listen_fd)
    _configure(sock, options)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # No handover: a second connection with a live peer's identity cannot take its place.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
    if options.curve is not None:
        apply_curve(sock, options.curve, server=True)
    elif options.password is not None:
        ensure_authenticator(ctx, password=options.password)
        sock.plain_server = True
        sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    ep = RpcEndpoint(sock, name, options)
    ep.address = _bind(sock, address)
    return ep


def connect_dealer(
    ctx: zmq.asyncio.Context,
    address: str,
    *,
    name: str,
    identity: str,
    options: ChannelOptions = ChannelOptions(),
) -> RpcEndpoint:
    """A DEALER with routing identity `identity`, connected to `address`."""
    sock = ctx.socket(zmq.DEALER)
    _configure(sock, options)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    if options.curve is not None:
        apply_curve(sock, options.curve, server=False)
    elif options.password is not None:
        sock.plain_username = PLAIN_USER
        sock.plain_password = options.password.encode()
    sock.connect(address)
    ep = RpcEndpoint(sock, name, options)
    ep.address = address
    return ep


def _configure(sock: zmq.asyncio.Socket, options: ChannelOptions) -> None:
    sock.setsockopt(zmq.SNDHWM, options.hwm)
    sock.setsockopt(zmq.RCVHWM, options.hwm)
    sock.setsockopt(zmq.LINGER, int(options.linger_s * 1000))
    sock.setsockopt(zmq.MAXMSGSIZE, options.max_message_bytes)


def _bind(sock: zmq.asyncio.Socket, address: str) -> str:
    if address.startswith("tcp://") and address.endswith(":0"):
        address = address[:-2] + ":*"
    sock.bind(address)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
