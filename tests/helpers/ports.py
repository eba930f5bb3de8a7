"""Rendezvous for a test's own torch.distributed worlds.

A port picked free, closed and then told to the ranks can be taken by another process of
a loaded suite before rank 0 binds it (the run dies of EADDRINUSE), so the tests' own
worlds meet without one where they can:
* `rendezvous_file(directory)`: an init_method for ranks the test spawns (a FileStore);
* `world_of_one(backend)`: this process as a world of one rank, its store on a port the
  store binds itself;
* `free_port()`: only for torchrun, which needs a port number.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist


def free_port() -> int:
    """A port nothing listens on now (another process may take it before the caller does)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rendezvous_file(directory: Path | str | None = None) -> str:
    """A `file://` init_method in a new, empty file under `directory` (a new temporary
    directory if None) for `dist.init_process_group(init_method=..., rank=, world_size=)`."""
    where = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="tandem-rendezvous-"))
    fd, path = tempfile.mkstemp(prefix="rendezvous-", dir=where)
    os.close(fd)
    os.unlink(path)  # FileStore makes it; it must not hold an earlier world's keys
    return f"file://{path}"


def world_of_one(backend: str = "gloo", device_id: torch.device | None = None) -> None:
    """This process as rank 0 of a world of one (RANK and WORLD_SIZE set for code that reads them)."""
    os.environ.update(RANK="0", WORLD_SIZE="1")
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, device_id=device_id)
