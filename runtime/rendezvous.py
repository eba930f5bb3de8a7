"""The trainer's and the critic's torch.distributed rendezvous, bound by the launcher.

A port the launcher only picked (bound, closed, told to the roles) could be taken by any
other process in the seconds before the role's rank 0 starts its TCPStore: a run then
ended with EADDRINUSE at the trainer's start. Instead the launcher binds and listens on
each world's port itself (`listen_for_worlds`) and hands the listening socket to that
world's rank 0 (`STORE_FD_ENV`, inherited through `pass_fds`), whose TCPStore serves on
it (roles.training.distributed). From the launcher's bind on, the port is the run's: the other ranks
connect to it as before (`MASTER_ADDR` / `MASTER_PORT`) and wait in its backlog until
rank 0's store accepts them.
"""

from __future__ import annotations

import socket

from runtime.placement import ProcSpec

STORE_FD_ENV = "TANDEM_STORE_FD"
WORLDS = ("trainer", "critic")  # the roles whose ranks form a torch.distributed world


def listen_for_worlds(specs: list[ProcSpec], addr: str) -> list[socket.socket]:
    """For each world in `specs` whose rank 0 is among them: a socket listening on a free
    port of `addr`; every rank of that world in `specs` gets the port as MASTER_PORT and
    rank 0 also `STORE_FD_ENV`. The caller passes each fd to its rank 0 (`store_fd`) and
    closes its own sockets once the roles are spawned."""
    out: list[socket.socket] = []
    for world in WORLDS:
        ranks = [s for s in specs if s.role == world]
        first = next((s for s in ranks if s.rank == 0), None)
        if first is None:
            continue
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind((addr, 0))
        sock.listen(128)
        out.append(sock)
        for s in ranks:
            s.env["MASTER_PORT"] = str(sock.getsockname()[1])
        first.env[STORE_FD_ENV] = str(sock.fileno())
    return out


def store_fd(spec: ProcSpec) -> int | None:
    """The listening socket's fd that `spec`'s process must inherit, if it is a rank 0."""
    fd = spec.env.get(STORE_FD_ENV, "")
    return int(fd) if fd.isdigit() else None
