"""The ports a single-node launcher picks, held from its bind on.

A port the launcher only picked (bound, closed, told to the roles) could be taken by any
other process in the seconds before the role that serves it starts: a CI run ended with
EADDRINUSE at trainer-0's start. Instead the launcher binds and listens on each such port
itself and hands the listening socket to the process that serves it, which inherits it
(`pass_fds`; the fd in its environment) and serves on it:
* each torch world's rendezvous (`listen_for_worlds`): the world's rank 0 (`STORE_FD_ENV`)
  runs its TCPStore on the socket (roles.training.distributed);
* the controller's ROUTER on TCP (`listen_for_controller`, `transport.use_ipc=false`):
  the controller (`CONTROLLER_FD_ENV`) binds it with ZMQ_USE_FD (transport.sockets).
The other processes connect to the port as before and wait in its backlog until the server
accepts them. With `--master-port` (several nodes) the ports are the user's and none of
this applies.
"""

from __future__ import annotations

import os
import socket

from runtime.config.placement import TORCH_WORLDS
from runtime.launch.placement import ProcSpec

STORE_FD_ENV = "TANDEM_STORE_FD"
CONTROLLER_FD_ENV = "TANDEM_CONTROLLER_FD"
FD_ENVS = (STORE_FD_ENV, CONTROLLER_FD_ENV)


def listen_for_worlds(specs: list[ProcSpec], addr: str) -> list[socket.socket]:
    """For each world in `specs` whose rank 0 is among them: a socket listening on a free
    port of `addr`; every rank of that world in `specs` gets the port as MASTER_PORT and
    rank 0 also `STORE_FD_ENV`. The caller passes the fds on (`inherited_fds`) and closes
    its own sockets once the roles are spawned."""
    out: list[socket.socket] = []
    for world in TORCH_WORLDS:
        ranks = [s for s in specs if s.role == world]
        first = next((s for s in ranks if s.rank == 0), None)
        if first is None:
            continue
        sock = listening_socket(addr)
        out.append(sock)
        for s in ranks:
            s.env["MASTER_PORT"] = str(sock.getsockname()[1])
        first.env[STORE_FD_ENV] = str(sock.fileno())
    return out


def listen_for_controller(specs: list[ProcSpec], host: str) -> socket.socket:
    """A socket listening on a free port of `host` (the controller's bind host), its fd in
    the controller's environment (`CONTROLLER_FD_ENV`); the caller tells every role the
    port and closes the socket once the roles are spawned."""
    controller = next(s for s in specs if s.role == "controller")
    sock = listening_socket(host)
    controller.env[CONTROLLER_FD_ENV] = str(sock.fileno())
    return sock


def inherited_fds(spec: ProcSpec) -> tuple[int, ...]:
    """The listening sockets' fds that `spec`'s process must inherit."""
    found = (spec.env.get(name, "") for name in FD_ENVS)
    return tuple(int(fd) for fd in found if fd.isdigit())


def handed_fd(name: str) -> int | None:
    """In a role: the listening socket's fd its launcher handed over under `name` (one of
    `FD_ENVS`), or None."""
    fd = os.environ.get(name, "")
    return int(fd) if fd.isdigit() else None


def listening_socket(host: str) -> socket.socket:
    """A TCP socket bound to a free port of `host` only (IPv6 where `host` has a colon)
    and listening, for a server to take over (a TCPStore's `master_listen_fd`, ZMQ_USE_FD)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(128)
    return sock
