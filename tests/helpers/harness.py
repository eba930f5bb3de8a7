"""Drive one real role process from a test or benchmark, standing in for the controller.

`RoleHarness` binds the controller's ROUTER where the role will look for it, answers its
`Register`, and lets the caller exchange messages with it; everything travels over
real ZeroMQ sockets between real processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import zmq.asyncio

from runtime.config import RunConfig
from runtime.identity import addresses
from runtime.identity.run_token import read_token
from runtime.launch.launcher import prepare_run_dir
from transport import wire
from transport.endpoint import Envelope
from transport.rpc import RpcEndpoint
from transport.sockets import bind_router

ROOT = Path(__file__).resolve().parents[2]


class RoleHarness:
    def __init__(self, cfg: RunConfig, role: str, rank: int = 0) -> None:
        self.cfg = cfg
        self.role = role
        self.rank = rank
        self.inbox: asyncio.Queue[Envelope] = asyncio.Queue()
        self.peer: wire.PeerInfo | None = None
        self.identity: bytes | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.zmq = zmq.asyncio.Context()
        self.server: RpcEndpoint | None = None
        self._registered = asyncio.Event()
        self._completions: dict[str, wire.Completion] = {}  # arrived before their `completion` call
        self._dealers = 0  # DEALERs made by `connect` (each gets its own routing identity)

    async def start(self, timeout: float = 300.0) -> wire.PeerInfo:
        run_dir = prepare_run_dir(self.cfg)
        address = addresses.controller_bind_address(self.cfg, run_dir)
        self.server = bind_router(
            self.zmq, address, name="harness", options=addresses.channel_options(self.cfg, run_dir)
        )
        self.server.start(self._on_message)
        env = {
            **os.environ,
            addresses.CONTROLLER_ENV: address,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1",
        }
        out = open(run_dir / "logs" / f"{self.role}-{self.rank}.out", "ab")  # noqa: SIM115
        cmd = [
            sys.executable,
            "-m",
            "runtime.entry",
            "--run-dir",
            str(run_dir),
            "--role",
            self.role,
            "--rank",
            str(self.rank),
        ]
        self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        waiter = asyncio.create_task(self._registered.wait())
        while not waiter.done():
            if self.proc.poll() is not None:
                waiter.cancel()
                raise RuntimeError(f"{self.role} exited with {self.proc.returncode} before registering")
            await asyncio.wait({waiter}, timeout=0.2)
        assert self.peer is not None
        return self.peer

    async def _on_message(self, env: Envelope) -> wire.Message | None:
        if isinstance(env.msg, wire.Register):
            self.peer, self.identity = env.msg.peer, env.peer
            self._registered.set()
            return wire.Registered(run_id="harness", peers=[env.msg.peer])
        await self.inbox.put(env)
        return None

    async def send(self, msg: wire.Message) -> None:
        assert self.server is not None
        await self.server.send(msg, peer=self.identity)

    async def request(self, msg: wire.Message, timeout: float = 60.0) -> wire.Message:
        assert self.server is not None
        return await self.server.request(msg, peer=self.identity, timeout=timeout)

    async def next(self, kind: type, timeout: float = 120.0) -> Any:
        """The next message of type `kind` from the role (others are skipped)."""
        while True:
            env = await asyncio.wait_for(self.inbox.get(), timeout)
            if isinstance(env.msg, kind):
                return env.msg

    async def completion(self, request_id: str, timeout: float = 120.0) -> wire.Completion:
        """The `Completion` of `request_id`, whenever it comes: completions of other requests
        that arrive first are kept for their own call (messages of other types are skipped)."""
        while request_id not in self._completions:
            env = await asyncio.wait_for(self.inbox.get(), timeout)
            if isinstance(env.msg, wire.Completion):
                self._completions[env.msg.request_id] = env.msg
        return self._completions.pop(request_id)

    def connect(self, address: str, name: str = "client") -> RpcEndpoint:
        """A DEALER to one of the role's own servers (e.g. a rollout's weights socket).

        Each DEALER gets its own routing identity (`name` plus a counter): servers bind with
        ROUTER_HANDOVER off, so a reconnect under the identity of a connection the server has
        not yet seen close would be refused, and its requests silently dropped."""
        from transport.sockets import connect_dealer

        self._dealers += 1
        ep = connect_dealer(
            self.zmq,
            address,
            name=name,
            identity=f"{name}-{self._dealers}",
            options=addresses.channel_options(self.cfg, self.cfg.run_dir),
        )
        ep.start()
        return ep

    async def stop(self, timeout: float = 30.0) -> int:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.proc.wait, timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # leftovers (vLLM engine processes)
            except ProcessLookupError:
                pass
        if self.server is not None:
            await self.server.aclose()
        self.zmq.destroy(linger=0)
        return self.proc.returncode if self.proc is not None else 0


async def greedy(
    h: RoleHarness, tag: str, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], list[list[float]], set[int]]:
    """Greedy completions of `prompts`, one request at a time (the same batch shape every
    time, so runs on the same weights compare token for token): their tokens, logprobs,
    and the set of policy versions that produced them."""
    tokens, logprobs, versions = [], [], set()
    for i, prompt in enumerate(prompts):
        spec = wire.SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        await h.send(wire.Generate(request_id=f"{tag}-{i}", group_id=i, prompt_ids=prompt, sampling=spec))
        c = await h.completion(f"{tag}-{i}")
        assert c.error == "", c.error
        tokens.append(c.token_ids.tolist())
        logprobs.append(c.logprobs.tolist())
        versions |= set(c.versions.tolist())
    return tokens, logprobs, versions


async def weight_checksums(h: RoleHarness) -> wire.WeightChecksums:
    """Every vLLM parameter's sum at the rollout's current version (its weights socket)."""
    assert h.peer is not None
    ep = h.connect(h.peer.address, name="checker")
    try:
        reply = await ep.request(wire.WeightChecksums(token=read_token(h.cfg.run_dir)), timeout=60)
    finally:
        await ep.aclose()
    assert isinstance(reply, wire.WeightChecksums)
    return reply
