"""What an endpoint does to every message: frames out, admission in, every drop counted.

A caller may rely on:

* `Endpoint.admit` never raises for bad input: a malformed, truncated, oversized,
  wrong-schema-version or unknown-type message is dropped, counted in
  `stats.dropped[reason]`, and logged (`message_dropped`, with the channel, the peer and
  the reason) — one by one at most DROP_LOG_FIRST times per peer and reason and
  DROP_LOG_PER_REASON times per reason over all peers in each DROP_WINDOW_S, the rest in
  `messages_dropped` summaries at most every DROP_SUMMARY_S (also with no further drop:
  `tick`, from the endpoint's heartbeat) that count every drop not logged one by one, by
  peer and reason, with the channel's totals. So a flood from any number of peers, with or
  without the run's token, costs a few lines a minute and every drop is counted in one.
* A message whose frames add up to more than `max_message_bytes` is dropped as
  `oversized` as soon as it is received (its frames are zero-copy views of the socket's
  buffers, let go at once), and no single frame above the cap is ever read (the
  connection is cut at the frame's length). A server without Curve (transport.zmtp_router)
  cuts a message at the cap before reading on, reported through `count_drop` as
  `oversized`, so no message costs it more than the cap; libzmq (clients, Curve servers)
  hands over a message only whole, so there a message of many frames each under the cap
  costs their sum until then (transport/sockets.py).
* `last_seen[peer]` is the time (`time.monotonic()`) anything last arrived from `peer`,
  dropped or not; `last_sent[peer]` the time a message last left for it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import structlog

from transport import wire
from transport.codec import Decoder, Encoder, WireError
from transport.security import CurveKeys

log = structlog.get_logger("transport")
DROP_LOG_FIRST = 3  # drops logged one by one per (peer, reason) and window
DROP_LOG_PER_REASON = 5  # and per reason over all peers and window
DROP_WINDOW_S = 60.0  # the one-by-one budgets renew this often
DROP_SUMMARY_S = 10.0  # the rest in one summary line at most this often
DROP_LOG_KEYS = 1024  # (peer, reason) pairs remembered; more fold into one "other peers" count


@dataclass(frozen=True)
class ChannelOptions:
    """Socket policy. Sizes in bytes, times in seconds."""

    hwm: int = 1000
    max_message_bytes: int = 1 << 30
    linger_s: float = 1.0
    heartbeat_s: float = 1.0
    peer_timeout_s: float = 10.0
    inline_threshold: int = 256
    curve: CurveKeys | None = None
    # The run token: with `curve` off, servers admit only peers presenting it at the ZMQ
    # handshake (PLAIN + ZAP), so a stranger never gets a frame into their memory.
    password: str | None = None
    send_timeout_s: float = 60.0  # a send waits this long for room in a full queue


@dataclass
class ChannelStats:
    """Counters of one endpoint; `dropped` is keyed by drop reason."""

    sent: int = 0
    received: int = 0
    bytes_received: int = 0
    dropped: Counter[str] = field(default_factory=Counter)


@dataclass(slots=True)
class Envelope:
    """A received message with its header and (ROUTER side) the sender's identity."""

    msg: wire.Message
    header: wire.Header
    peer: bytes | None = None


class Endpoint:
    """The codec, size cap and drop accounting of one ROUTER or DEALER socket.

    On a ROUTER every message starts with the peer's identity frame: `frames` adds it,
    `admit` takes it off. A DEALER's only peer is `None` (the server)."""

    def __init__(self, name: str, options: ChannelOptions, *, is_router: bool) -> None:
        self.name = name
        self.options = options
        self.is_router = is_router
        self.stats = ChannelStats()
        self.last_sent: dict[bytes | None, float] = {}
        self.last_seen: dict[bytes | None, float] = {}
        self._encoder = Encoder(options.inline_threshold)
        self._decoder = Decoder()
        self.drop_log = DropLog(name)

    def frames(self, msg: wire.Message, peer: bytes | None, corr: int = 0, flags: int = 0) -> list[Any]:
        """The frames that carry `msg` (to `peer` on a ROUTER, which needs one)."""
        frames = self._encoder.encode(msg, corr=corr, flags=flags)
        if self.is_router:
            if peer is None:
                raise ValueError(f"{self.name}: a ROUTER send needs a peer")
            frames.insert(0, peer)
        return frames

    def sent(self, peer: bytes | None) -> None:
        """Account for a message that left for `peer`."""
        self.stats.sent += 1
        self.last_sent[peer] = time.monotonic()

    def count_drop(self, peer: bytes | None, reason: str, detail: str) -> None:
        """Count and log (rate-limited) one message dropped for `reason`."""
        self.stats.dropped[reason] += 1
        self.drop_log.dropped(peer_name(peer), reason, detail)

    def admit(self, frames: list[Any]) -> Envelope | None:
        """The message `frames` carry, or None when it is dropped (see the module docstring)."""
        peer = None
        if self.is_router:
            peer, frames = frames[0].bytes, frames[1:]
        self.last_seen[peer] = time.monotonic()
        size = sum(map(len, frames))  # zmq frames: len() is the byte size
        self.stats.bytes_received += size
        try:
            if size > self.options.max_message_bytes:
                raise WireError("oversized", f"{size} bytes > max {self.options.max_message_bytes}")
            header, msg = self._decoder.decode(frames)
        except WireError as exc:
            self.count_drop(peer, exc.reason, exc.detail)
            return None
        self.stats.received += 1
        return Envelope(msg=msg, header=header, peer=peer)


class DropLog:
    """Rate-limited logging of dropped messages (see the module docstring)."""

    def __init__(self, channel: str, clock: Any = time.monotonic) -> None:
        self.channel = channel
        self.clock = clock
        self.seen: Counter[tuple[str, str]] = Counter()  # per (peer, reason), all along
        self.totals: Counter[str] = Counter()  # per reason, all along
        self.logged: Counter[tuple[str, str]] = Counter()  # logged one by one in this window
        self.logged_reasons: Counter[str] = Counter()
        self.unlogged: Counter[tuple[str, str]] = Counter()  # since the last summary
        self.window_start = self.last_summary = clock()

    def dropped(self, peer: str, reason: str, detail: str) -> None:
        key = (
            (peer, reason) if (peer, reason) in self.seen or len(self.seen) < DROP_LOG_KEYS else ("other peers", reason)
        )
        self.seen[key] += 1
        self.totals[reason] += 1
        now = self.clock()
        if now - self.window_start >= DROP_WINDOW_S:
            self.window_start = now
            self.logged.clear()
            self.logged_reasons.clear()
        if self.logged[key] < DROP_LOG_FIRST and self.logged_reasons[reason] < DROP_LOG_PER_REASON:
            self.logged[key] += 1
            self.logged_reasons[reason] += 1
            log.warning("message_dropped", channel=self.channel, peer=peer, reason=reason, detail=detail[:200])
            return
        self.unlogged[key] += 1
        self.tick(now)

    def tick(self, now: float | None = None) -> None:
        """A summary if one is due (drops not logged since the last, DROP_SUMMARY_S ago)."""
        now = self.clock() if now is None else now
        if self.unlogged and now - self.last_summary >= DROP_SUMMARY_S:
            self.summary(now)

    def summary(self, now: float | None = None) -> None:
        """Log the drops not logged one by one since the last summary, if any."""
        if self.unlogged:
            counts = {f"{p}/{r}": n for (p, r), n in self.unlogged.most_common(20)}
            log.warning(
                "messages_dropped",
                channel=self.channel,
                unlogged=sum(self.unlogged.values()),
                peers=len({p for p, _ in self.unlogged}),
                counts=counts,
                total=dict(self.totals),
            )
            self.unlogged.clear()
        self.last_summary = self.clock() if now is None else now


def peer_name(peer: bytes | None) -> str:
    """A peer identity for logs and errors; a DEALER's peer (None) is the server."""
    if peer is None:
        return "server"
    try:
        return peer.decode()
    except UnicodeDecodeError:
        return peer.hex()
