"""A free TCP port on 127.0.0.1 for a test's own rendezvous (torch.distributed, torchrun)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (another process may take it before the caller does)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
