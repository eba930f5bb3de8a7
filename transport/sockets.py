"""The sockets endpoints use, with the policy of `ChannelOptions` applied.

Every socket has explicit high-water marks, a linger bound and a size cap of
`max_message_bytes`. A server (`bind_router`) without Curve is a `ZmtpRouter`
(transport/zmtp_router.py), which bounds a whole message: it reads each frame's length
first and cuts a peer whose message would grow past the cap, counting it as `oversized`,
so no message costs it more than the cap. With Curve the server is libzmq's ROUTER,
whose ZMQ_MAXMSGSIZE caps each frame only: libzmq hands over a message only whole and
has no limit on the number of frames, so there a Curve key holder's message of several
frames under the cap costs their sum until `Endpoint.admit` drops it. Clients are
libzmq DEALERs with a per-frame cap.
Only a peer that passed the handshake can send a frame at all: with `options.curve` the
peer needs the run's Curve key, otherwise, with `options.password` (the run token), it
must present that token (ZMQ PLAIN; checked by the ZmtpRouter in constant time), so a
stranger's frames never reach memory.
A ROUTER routes mandatorily, so a send to an unknown peer is an error (`PeerUnreachable`)
rather than a silent loss, and it refuses a newcomer with a live peer's identity.
"""

from __future__ import annotations

import zmq
import zmq.asyncio

from transport.endpoint import ChannelOptions
from transport.rpc import RpcEndpoint
from transport.security import PLAIN_USER, apply_curve
from transport.zmtp_router import ZmtpRouter


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
    launcher hands one over, runtime.launch.rendezvous), the ROUTER serves on it and owns it
    from then on. Without Curve it is a ZmtpRouter (needs a running event loop)."""
    if options.curve is None:
        return _bind_zmtp(address, name, options, listen_fd)
    sock = ctx.socket(zmq.ROUTER)
    if listen_fd is not None:
        sock.setsockopt(zmq.USE_FD, listen_fd)
    _configure(sock, options)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # No handover: a second connection with a live peer's identity cannot take its place.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
    apply_curve(sock, options.curve, server=True)
    ep = RpcEndpoint(sock, name, options)
    ep.address = _bind(sock, address)
    return ep


def _bind_zmtp(address: str, name: str, options: ChannelOptions, listen_fd: int | None) -> RpcEndpoint:
    router = ZmtpRouter(
        address,
        name=name,
        max_message_bytes=options.max_message_bytes,
        hwm=options.hwm,
        linger_s=options.linger_s,
        password=options.password,
        listen_fd=listen_fd,
    )
    ep = RpcEndpoint(router, name, options)
    router.on_oversized = lambda peer, detail: ep.count_drop(peer, "oversized", detail)
    ep.address = router.address
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
