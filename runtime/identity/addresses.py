"""Where sockets live: ipc:// paths for one node, tcp:// for several, and socket policy.

ipc paths are kept short (Unix socket paths are limited to ~107 bytes) by placing them
in a per-run folder under the temp dir named by a hash of the run directory. That folder
is this user's and mode 0700 (`sock_dir` fixes the mode, and refuses a path another user
or a symlink holds), so no other user reaches a run's sockets through it.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path

from runtime.config import RunConfig
from runtime.identity.run_token import read_token, token_path
from transport.endpoint import ChannelOptions

CONTROLLER_ENV = "TANDEM_CONTROLLER"


def sock_dir(run_dir: str | Path) -> Path:
    digest = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"tandem-{digest}"
    path.mkdir(mode=0o700, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise RuntimeError(f"{path} (the run's socket directory) is not a directory of this user: refusing it")
    if stat.S_IMODE(st.st_mode) != 0o700:
        path.chmod(0o700)
    return path


def multi_node(cfg: RunConfig) -> bool:
    return int(os.environ.get("TANDEM_NNODES", "1")) > 1 or os.environ.get("TANDEM_JOIN", "") != ""


def controller_bind_address(cfg: RunConfig, run_dir: str | Path) -> str:
    """Where the controller binds its ROUTER."""
    if cfg.transport.use_ipc and not multi_node(cfg):
        return f"ipc://{sock_dir(run_dir)}/controller"
    port = os.environ.get("TANDEM_CONTROLLER_PORT", "0")
    return f"tcp://{cfg.transport.bind_host}:{port}"


def server_bind_address(cfg: RunConfig, run_dir: str | Path, name: str, rank: int = 0) -> str:
    """Where a role binds a server of its own (e.g. a rollout's weight socket)."""
    if cfg.transport.use_ipc and not multi_node(cfg):
        return f"ipc://{sock_dir(run_dir)}/{name}"
    port = cfg.transport.server_port + rank if cfg.transport.server_port else 0
    return f"tcp://{cfg.transport.bind_host}:{port}"


def advertise_host(bind_host: str, peer_host: str) -> str:
    """The address other hosts reach this one at: the bind address, or for a wildcard bind
    the local address of the route towards `peer_host` (node 0 or the job joined)."""
    import socket

    if bind_host not in ("0.0.0.0", "*", ""):
        return bind_host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer_host, 9))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def advertised(address: str) -> str:
    """The address peers should connect to (a wildcard bind is replaced by this host)."""
    if address.startswith(("tcp://0.0.0.0:", "tcp://*:")):
        host = os.environ.get("TANDEM_ADVERTISE_HOST", "127.0.0.1")
        return f"tcp://{host}:{address.rsplit(':', 1)[1]}"
    return address


def channel_options(cfg: RunConfig, run_dir: str | Path) -> ChannelOptions:
    """The run's socket policy. Its servers admit only peers holding the run's Curve key
    (`transport.curve`) or else presenting the run token at the handshake; the token is
    left out only where `RUN_DIR/keys/run_token` does not exist (the launcher makes it
    before any role starts, and registration refuses a role without it)."""
    t = cfg.transport
    curve = None
    if t.curve:
        from transport.security import load_keys

        curve = load_keys(t.keys_dir or Path(run_dir) / "keys")
    token = token_path(run_dir)
    return ChannelOptions(
        password=read_token(run_dir) if token.exists() else None,
        hwm=t.hwm,
        max_message_bytes=t.max_message_mb << 20,
        heartbeat_s=t.heartbeat_s,
        peer_timeout_s=t.peer_timeout_s,
        curve=curve,
        send_timeout_s=t.send_timeout_s,
    )
