"""The ports a launcher picks (torch worlds' rendezvous, the controller on TCP) are the run's
from its bind on.

The launcher used to pick a free port, close it and tell the ranks; in a loaded CI suite
another process took it before trainer-0's TCPStore started and the run died of
EADDRINUSE. Here the launcher's listening socket is handed to rank 0 (real processes, a
real gloo world), and the port cannot be taken at any point in between.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.config.load import load_config
from runtime.launch.placement import ProcSpec, plan_processes
from runtime.launch.rendezvous import STORE_FD_ENV, inherited_fds, listen_for_controller, listen_for_worlds

ROOT = Path(__file__).resolve().parents[2]
RANK_CODE = """
import torch, torch.distributed as dist
from roles.training.distributed import init_distributed
init_distributed(torch.device("cpu"), 60)
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print("sum", t.item(), flush=True)
dist.destroy_process_group()
"""


def _taken(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            assert exc.errno == errno.EADDRINUSE, exc
            return True
    return False


def test_each_world_gets_its_own_held_port_and_only_rank_0_the_socket() -> None:
    cfg = load_config(None, ["algorithm.advantage=gae"])
    specs = plan_processes(cfg)
    listeners = listen_for_worlds(specs, "127.0.0.1")
    try:
        by_name = {s.name: s for s in specs}
        trainer_port = by_name["trainer-0"].env["MASTER_PORT"]
        critic_port = by_name["critic-0"].env["MASTER_PORT"]
        assert by_name["trainer-1"].env["MASTER_PORT"] == trainer_port != critic_port
        assert _taken(int(trainer_port)) and _taken(int(critic_port))
        assert len(inherited_fds(by_name["trainer-0"])) == 1 == len(inherited_fds(by_name["critic-0"]))
        assert inherited_fds(by_name["trainer-1"]) == ()
        assert "MASTER_PORT" not in by_name["rollout-0"].env and inherited_fds(by_name["rollout-0"]) == ()
        assert len(listeners) == 2
    finally:
        for sock in listeners:
            sock.close()


def test_a_world_without_its_rank_0_here_gets_no_socket() -> None:
    specs = [ProcSpec(role="trainer", rank=1, env={"MASTER_PORT": "4000"})]
    assert listen_for_worlds(specs, "127.0.0.1") == []
    assert specs[0].env == {"MASTER_PORT": "4000"}


@pytest.mark.timeout(180)
def test_rank_0_serves_on_the_launchers_socket_and_the_port_is_never_free() -> None:
    specs = [ProcSpec(role="trainer", rank=r) for r in range(2)]
    for s in specs:
        s.env.update(RANK=str(s.rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    listeners = listen_for_worlds(specs, "127.0.0.1")
    port = int(specs[0].env["MASTER_PORT"])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(STORE_FD_ENV, None)
    procs = []
    for s in specs:
        pass_fds = inherited_fds(s)
        out = subprocess.PIPE
        cmd = [sys.executable, "-c", RANK_CODE]
        procs.append(
            subprocess.Popen(cmd, env={**env, **s.env}, cwd=ROOT, text=True, stdout=out, stderr=out, pass_fds=pass_fds)
        )
    for sock in listeners:
        sock.close()
    assert _taken(port)  # rank 0 holds it now, before (and while) its store starts
    outs = [p.communicate(timeout=150)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("sum 3.0" in out for out in outs), outs


async def test_the_controller_serves_on_the_launchers_socket() -> None:
    """ZMQ_USE_FD: the ROUTER takes the handed socket; a DEALER reaches it on the port."""
    import zmq.asyncio

    from transport.sockets import bind_router, connect_dealer

    specs = [ProcSpec(role="controller", rank=0), ProcSpec(role="rollout", rank=0)]
    sock = listen_for_controller(specs, "127.0.0.1")
    port = sock.getsockname()[1]
    (fd,) = inherited_fds(specs[0])
    assert inherited_fds(specs[1]) == ()
    ctx = zmq.asyncio.Context()
    router = bind_router(ctx, f"tcp://127.0.0.1:{port}", name="controller", listen_fd=os.dup(fd))
    sock.close()  # as the launcher does once the controller is spawned
    dealer = connect_dealer(ctx, f"tcp://127.0.0.1:{port}", name="rollout", identity="rollout-0")
    try:
        assert _taken(port)
        assert router.address == f"tcp://127.0.0.1:{port}"
        await dealer.sock.send(b"hello")
        assert await asyncio.wait_for(router.sock.recv_multipart(), 10) == [b"rollout-0", b"hello"]
    finally:
        dealer.sock.close(0)
        router.sock.close(0)
        ctx.term()
