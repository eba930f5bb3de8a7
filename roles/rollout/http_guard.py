"""Slow clients on the endpoint: a connection holds a descriptor only while it makes progress.

aiohttp reads a request's headers with no deadline, so a client that sends them a byte at a
time (or connects and sends nothing) holds a descriptor and a protocol object for as long
as it likes. `ConnectionGuard` wraps the server's protocol factory; what a caller may rely on:
* A connection that is not inside a request (`busy` not entered) for `header_timeout_s`,
  counted from its opening or from the end of its last request, is closed: counted in
  `closed_slow` when it sent part of a request or nothing at all since it connected (a
  request is entered once its headers are whole, so a client that has not sent them by
  then is cut off), in `closed_idle` when it is a keep-alive connection that sent nothing
  after its last reply (clients reconnect; httpx drops its own idle ones after 5 s).
* The body of a request is the handler's to bound (`openai_server` reads it with
  `rollout.openai.body_timeout_s`).
* `open_connections()` is the number of connections the server holds now.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


class _Watched(asyncio.Protocol):
    """Forwards every event to aiohttp's protocol; the guard sees the connection's life."""

    def __init__(self, inner: Any, guard: ConnectionGuard) -> None:
        self.inner = inner
        self.guard = guard
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.guard._opened(transport)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.guard._started.add(self.transport)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()  # type: ignore[no-any-return]

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard._lost(self.transport)
        self.inner.connection_lost(exc)


class ConnectionGuard:
    def __init__(self, header_timeout_s: float, on_slow: Callable[[int], None] | None = None) -> None:
        """`on_slow(closed_slow)`: called after each slow client is closed."""
        self.header_timeout_s = header_timeout_s
        self.on_slow = on_slow
        self.closed_slow = 0
        self.closed_idle = 0
        self._idle_since: dict[Any, float] = {}  # transport -> when it last left a request (or opened)
        self._busy: dict[Any, int] = {}  # transport -> requests in progress
        self._started: set[Any] = set()  # transports that sent bytes of a request not yet entered
        self._served: set[Any] = set()  # transports that completed a request
        self._sweeper: asyncio.Task[None] | None = None

    def factory(self, make: Callable[[], Any]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for `loop.create_server`, wrapping aiohttp's `make`."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="endpoint-slow-clients")
        return lambda: _Watched(make(), self)

    def busy(self, transport: Any) -> _Busy:
        """`with guard.busy(request.transport):` around a request's handling."""
        return _Busy(self, transport)

    def open_connections(self) -> int:
        return len(self._idle_since)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def _opened(self, transport: Any) -> None:
        self._idle_since[transport] = time.monotonic()

    def _lost(self, transport: Any) -> None:
        self._idle_since.pop(transport, None)
        self._busy.pop(transport, None)
        self._started.discard(transport)
        self._served.discard(transport)

    async def _sweep(self) -> None:
        period = max(0.05, min(1.0, self.header_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for transport, since in list(self._idle_since.items()):
                if not self._busy.get(transport) and now - since > self.header_timeout_s:
                    self._idle_since.pop(transport, None)
                    if transport in self._started or transport not in self._served:
                        self.closed_slow += 1  # a partial request, or nothing at all since it connected
                        if self.on_slow is not None:
                            self.on_slow(self.closed_slow)
                    else:
                        self.closed_idle += 1
                    transport.abort()


class _Busy:
    def __init__(self, guard: ConnectionGuard, transport: Any) -> None:
        self.guard, self.transport = guard, transport

    def __enter__(self) -> None:
        if self.transport is not None:
            self.guard._busy[self.transport] = self.guard._busy.get(self.transport, 0) + 1
            self.guard._started.discard(self.transport)

    def __exit__(self, *exc: object) -> None:
        g, t = self.guard, self.transport
        if t is not None and t in g._busy:
            g._busy[t] -= 1
            g._served.add(t)
            if t in g._idle_since:
                g._idle_since[t] = time.monotonic()
