"""Handshake authentication: CurveZMQ for cross-host runs, PLAIN with the run token locally.

A run has one key pair shared by its roles (`generate_keys` writes it, `tandem keys
RUN_DIR` calls that). Servers accept only clients whose public key is listed in
`CurveKeys.allowed_clients`; the ZAP handler installed by `start_authenticator` refuses
everyone else and logs each refusal with the peer's address and reason. A plaintext
peer cannot complete the handshake with a Curve socket at all; `log_refused_handshakes`
logs and counts those failures as they happen (a socket monitor on the server).

Local runs (no Curve) authenticate with ZMQ's PLAIN mechanism instead: a client presents
the run token (runtime/identity/run_token.py) as its password; the server
(transport.zmtp_router, which runs its own handshake and logs through `note_refused`)
compares it in constant time and refuses (logs, counts) any other; no ZAP handler is
involved. PLAIN sends the token in clear over
the connection, which is why it is for ipc:// in a 0700 folder and loopback only; data
frames are not encrypted, so it costs the data path nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog
import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

from transport.throttle import Throttled

log = structlog.get_logger("transport")
_refusals = Throttled(log)  # a peer can retry a refused handshake at will

PUBLIC_FILE = "tandem.key"
SECRET_FILE = "tandem.key_secret"
ZAP_DOMAIN = "tandem"
PLAIN_USER = b"tandem"


@dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded keys: this process's pair, the server's public key, allowed clients."""

    public: bytes
    secret: bytes
    server_public: bytes
    allowed_clients: tuple[bytes, ...] = ()


def generate_keys(directory: str | Path) -> Path:
    """Write a new key pair into `directory` (created 0700, secret file 0600)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    public, secret = zmq.curve_keypair()
    (d / PUBLIC_FILE).write_bytes(public + b"\n")
    secret_path = d / SECRET_FILE
    secret_path.write_bytes(public + b"\n" + secret + b"\n")
    secret_path.chmod(0o600)
    return d


def load_keys(directory: str | Path) -> CurveKeys:
    """The run's keys from `directory`; a clear error names a missing or bad file."""
    d = Path(directory)
    try:
        lines = (d / SECRET_FILE).read_bytes().split()
    except FileNotFoundError:
        raise FileNotFoundError(f"no CurveZMQ keys in {d} (run `tandem keys RUN_DIR`)") from None
    if len(lines) != 2 or any(len(k) != 40 for k in lines):
        raise ValueError(f"{d / SECRET_FILE}: expected a Z85 public and secret key (40 chars each)")
    public, secret = lines
    return CurveKeys(public=public, secret=secret, server_public=public, allowed_clients=(public,))


def apply_curve(sock: zmq.Socket, keys: CurveKeys, *, server: bool) -> None:
    """Turn on CurveZMQ for `sock` as a server (authenticating) or a client."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    if server:
        sock.curve_server = True
        sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    else:
        sock.curve_serverkey = keys.server_public


class _LoggingAuthenticator(AsyncioAuthenticator):
    """ZAP handler that logs every refused peer and counts refusals."""

    refused = 0

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        allowed, reason = await super()._authenticate_curve(domain, client_key)
        if not allowed:
            type(self).refused += 1
            _refusals.warning("peer_refused", key="CURVE", mechanism="CURVE", reason=reason.decode(errors="replace"))
        return allowed, reason


def start_authenticator(ctx: zmq.asyncio.Context, keys: CurveKeys) -> AsyncioAuthenticator:
    """Start the ZAP handler of `ctx` (one per context, needs a running event loop): a
    Curve client must hold one of `keys.allowed_clients`; every other peer is refused,
    logged (throttled) and counted."""
    auth = _LoggingAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_Allowed(keys.allowed_clients))
    return auth


class _Allowed:
    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self.keys = set(keys)

    def callback(self, domain: str, z85_key: bytes) -> bool:
        return z85_key in self.keys


def refused_count() -> int:
    """Peers refused so far in this process: wrong keys (ZAP) and failed handshakes."""
    return _LoggingAuthenticator.refused + _handshakes_refused[0]


_handshakes_refused = [0]
# A wrong key fails in ZAP, which logs it already (with the reason); these are the
# failures ZAP never sees, such as a plaintext peer at a Curve server.
_HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


def note_refused(mechanism: str, reason: str, *, key: str, **fields: str) -> None:
    """Log (`peer_refused`, throttled per `key`) and count one refused peer: for servers
    that run their own handshake (transport.zmtp_router) rather than libzmq's."""
    _handshakes_refused[0] += 1
    _refusals.warning("peer_refused", key=key, mechanism=mechanism, reason=reason, **fields)


async def log_refused_handshakes(sock: object, channel: str) -> None:
    """Log (`peer_refused`) and count every peer whose handshake with the Curve server
    `sock` failed before authentication. Runs until cancelled or the socket closes. A
    server that is no libzmq socket (transport.zmtp_router) logs its refusals itself."""
    if not isinstance(sock, zmq.asyncio.Socket):
        return
    monitor = sock.get_monitor_socket(_HANDSHAKE_FAILURES)
    try:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            _handshakes_refused[0] += 1
            _refusals.warning(
                "peer_refused",
                key=f"handshake {channel}",  # per socket: one noisy peer mutes no other
                channel=channel,
                mechanism="handshake",
                reason=_HANDSHAKE_REASONS.get(event["event"], str(event["event"])),
                endpoint=event["endpoint"].decode(errors="replace"),
            )
    except zmq.ZMQError:
        return
    finally:
        if not sock.closed:
            sock.disable_monitor()
        monitor.close(linger=0)


_HANDSHAKE_REASONS: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "security mechanism mismatch (a peer without the run's Curve key or token?)",
}
