"""Node topology: Slurm host-list expansion and flags-over-Slurm-over-defaults resolution."""

from __future__ import annotations

import argparse

import pytest

from runtime.launch.multinode import DEFAULT_PORT, expand_nodelist, resolve_launch_options
from runtime.launch.options import LaunchOptions


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("a,b", ["a", "b"]),
        ("gpu5", ["gpu5"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("node[01-02],gpu5,x[3]", ["node01", "node02", "gpu5", "x3"]),
        ("", []),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["node[01-03", "node01]", "n[a-b]", "n[1-]", "n[]", "n[1,,2]", "n[-2]", "n[3-1]"])
def test_malformed_nodelist_raises(nodelist: str) -> None:
    with pytest.raises(ValueError, match="bad Slurm node list"):
        expand_nodelist(nodelist)


def _args(
    nnodes: int | None = None, node_rank: int | None = None, master_addr: str = "", master_port: int | None = None
) -> argparse.Namespace:
    return argparse.Namespace(
        nnodes=nnodes, node_rank=node_rank, master_addr=master_addr, master_port=master_port, join=""
    )


def test_single_node_defaults() -> None:
    assert resolve_launch_options(_args(), {}) == LaunchOptions(0, 1, "127.0.0.1", 0, "")
    # An explicit port is kept even on one node.
    assert resolve_launch_options(_args(master_port=4000), {}).master_port == 4000


def test_flags_alone() -> None:
    opts = resolve_launch_options(_args(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29600), {})
    assert opts == LaunchOptions(node_rank=1, nnodes=2, master_addr="10.0.0.1", master_port=29600, join="")
    opts = resolve_launch_options(_args(nnodes=2, node_rank=0, master_addr="10.0.0.1"), {})
    assert opts.master_port == DEFAULT_PORT


SLURM = {"SLURM_NNODES": "3", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[01-03]"}


def test_slurm_environment_alone() -> None:
    opts = resolve_launch_options(_args(), SLURM)
    assert opts == LaunchOptions(node_rank=2, nnodes=3, master_addr="gpu01", master_port=DEFAULT_PORT, join="")


def test_step_nodelist_wins_over_job_nodelist() -> None:
    env = {**SLURM, "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "gpu[02-03]"}
    assert resolve_launch_options(_args(), env).master_addr == "gpu02"
    assert resolve_launch_options(_args(), {**env, "SLURM_STEP_NODELIST": ""}).master_addr == "gpu01"


def test_flags_override_slurm() -> None:
    opts = resolve_launch_options(_args(nnodes=2, node_rank=0, master_addr="head", master_port=7000), SLURM)
    assert opts == LaunchOptions(node_rank=0, nnodes=2, master_addr="head", master_port=7000, join="")
    # A flag overrides only its own field.
    opts = resolve_launch_options(_args(node_rank=1), SLURM)
    assert (opts.node_rank, opts.nnodes, opts.master_addr) == (1, 3, "gpu01")


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (_args(nnodes=2, node_rank=2, master_addr="h"), {}),
        (_args(nnodes=2, node_rank=-1, master_addr="h"), {}),
        (_args(nnodes=0, node_rank=0), {}),
        (_args(), {**SLURM, "SLURM_NODEID": "3"}),
    ],
)
def test_node_rank_out_of_range(args: argparse.Namespace, env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match=r"is outside 0\.\."):
        resolve_launch_options(args, env)


def test_several_nodes_need_a_master_address() -> None:
    with pytest.raises(ValueError, match="needs --master-addr"):
        resolve_launch_options(_args(nnodes=2, node_rank=0), {})
    with pytest.raises(ValueError, match="needs --master-addr"):
        resolve_launch_options(_args(), {"SLURM_NNODES": "2", "SLURM_NODEID": "0"})


def test_join_is_passed_through() -> None:
    args = _args()
    args.join = "head:5555"
    assert resolve_launch_options(args, {}).join == "head:5555"
