"""The node topology a launcher runs with (see runtime.launch.multinode for how it is resolved)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchOptions:
    node_rank: int = 0
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: pick free ports (single node)
    join: str = ""  # HOST:PORT of a running job's controller: start rollout roles only
