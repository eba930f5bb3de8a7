"""Node topology of a launch: torchrun-style flags, else Slurm's environment, else one node.

`resolve_launch_options(args, environ)` gives the node count, this node's rank and node
0's address. Explicit flags win over `SLURM_NNODES` / `SLURM_NODEID` /
`SLURM_STEP_NODELIST` (or `SLURM_JOB_NODELIST`), whose first host is node 0.
"""

from __future__ import annotations

import argparse
import itertools
import re
from collections.abc import Mapping

from runtime.launch.options import LaunchOptions

DEFAULT_PORT = 29500


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list: `node[01-03,07],gpu5` → node01..node03, node07, gpu5."""
    hosts: list[str] = []
    for item in _split_top(nodelist.strip()):
        if item:
            hosts.extend(_expand_item(item))
    return hosts


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"bad Slurm node list '{text}': unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise ValueError(f"bad Slurm node list '{text}': unbalanced '['")
    parts.append(cur)
    return parts


def _expand_item(item: str) -> list[str]:
    pieces = re.split(r"(\[[^\]]*\])", item)
    choices = [_expand_range(p[1:-1], item) if p.startswith("[") else [p] for p in pieces]
    return ["".join(combo) for combo in itertools.product(*choices)]


def _expand_range(spec: str, item: str) -> list[str]:
    out: list[str] = []
    for part in spec.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and (not hi.isdigit() or int(hi) < int(lo))):
            raise ValueError(f"bad Slurm node list '{item}': range '{part}'")
        if not sep:
            out.append(lo)
            continue
        width = len(lo)
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def resolve_launch_options(args: argparse.Namespace, environ: Mapping[str, str]) -> LaunchOptions:
    """Flags first, then Slurm, then a single node on loopback."""
    slurm_hosts = expand_nodelist(environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or "")
    nnodes = args.nnodes if args.nnodes is not None else int(environ.get("SLURM_NNODES") or 1)
    node_rank = args.node_rank if args.node_rank is not None else int(environ.get("SLURM_NODEID") or 0)
    master = args.master_addr or (slurm_hosts[0] if slurm_hosts else "127.0.0.1")
    port = args.master_port if args.master_port is not None else DEFAULT_PORT
    join = getattr(args, "join", "") or ""
    if join:
        # A joining launcher only picks the rollout entries placed on --node-rank.
        return LaunchOptions(node_rank=node_rank, nnodes=max(nnodes, node_rank + 1), master_addr=master, join=join)
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} is outside 0..{nnodes - 1} (--nnodes {nnodes})")
    if nnodes > 1 and master in ("127.0.0.1", "localhost") and not args.master_addr:
        raise ValueError("--nnodes > 1 needs --master-addr (node 0's address) or a Slurm node list")
    return LaunchOptions(
        node_rank=node_rank,
        nnodes=nnodes,
        master_addr=master,
        master_port=port if (nnodes > 1 or args.master_port is not None) else 0,
    )
