"""The controller's membership (roles/controller/membership.py) over real ZeroMQ sockets:
a real ROUTER serves `Register` and `Dead` through `Membership`, and trainer and rollout
processes are played by real DEALERs that register, receive `Peers` / `SyncWeights` and
answer them. Registry, peer access and rank group are the real ones; only the dispatcher
and the role that hold the membership are small recorders."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any

import pytest
import zmq.asyncio

from roles.controller.groups import Group
from roles.controller.membership import Membership, MembershipRules
from roles.controller.peers import Peer, Registry
from roles.controller.ranks import RankGroup
from runtime.role import FatalError
from transport import wire
from transport.endpoint import Envelope
from transport.rpc import RemoteError, RpcEndpoint
from transport.sockets import bind_router, connect_dealer

TOKEN = "a" * 64


@dataclass
class Pool:
    """Records what membership asks of the dispatcher."""

    woken: int = 0
    lost: list[str] = field(default_factory=list)

    def wake(self) -> None:
        self.woken += 1

    def lose(self, peer: Peer) -> list[Group]:
        peer.alive = False  # as the dispatcher does: a lost peer is no longer live
        self.lost.append(peer.name)
        return []


@dataclass
class Host:
    """The role holding the membership: runs its tasks, records why it failed."""

    failed: list[str] = field(default_factory=list)
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    stopping: bool = False

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        self.tasks.append(asyncio.create_task(coro, name=name))
        return self.tasks[-1]

    def fail(self, cause: str) -> None:
        self.failed.append(cause)


class Member:
    """One role process's socket: registers and keeps every message the controller sends."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, role: str, rank: int, version: int = 0) -> None:
        self.info = wire.PeerInfo(role=role, rank=rank, version=version)
        self.inbox: asyncio.Queue[wire.Message] = asyncio.Queue()
        self.ep = connect_dealer(ctx, address, name=f"{role}-{rank}", identity=f"{role}-{rank}")
        self.ep.start(self._on_message)

    async def _on_message(self, env: Envelope) -> wire.Message | None:
        await self.inbox.put(env.msg)
        return wire.Ack() if isinstance(env.msg, wire.SyncWeights) else None

    async def register(self, token: str = TOKEN) -> wire.Message:
        return await self.ep.request(wire.Register(peer=self.info, token=token), timeout=5)

    async def next(self, kind: type[wire.Message]) -> Any:
        while True:
            msg = await asyncio.wait_for(self.inbox.get(), 5)
            if isinstance(msg, kind):
                return msg


@dataclass
class Run:
    membership: Membership
    pool: Pool
    host: Host
    server: RpcEndpoint
    ctx: zmq.asyncio.Context
    version: list[int]
    members: list[Member] = field(default_factory=list)

    def member(self, role: str, rank: int, version: int = 0) -> Member:
        self.members.append(Member(self.ctx, self.server.address, role, rank, version))
        return self.members[-1]


async def start(*, elastic: bool, expected: dict[str, int] | None = None, grace_s: float = 60.0) -> Run:
    ctx = zmq.asyncio.Context()
    server = bind_router(ctx, "tcp://127.0.0.1:0", name="controller")
    registry, pool, host, version = Registry(), Pool(), Host(), [0]
    rules = MembershipRules(
        expected=expected or {"controller": 1, "trainer": 1, "rollout": 1}, token=TOKEN, elastic=elastic,
        elastic_grace_s=grace_s, peer_timeout_s=3.0, sync_timeout_s=5.0,
    )  # fmt: skip
    membership = Membership(
        registry, server, RankGroup("trainer", server, registry), pool, rules, run_id="run-1",
        version=lambda: version[0], host=host,
    )  # fmt: skip

    async def on_message(env: Envelope) -> wire.Message | None:
        if isinstance(env.msg, wire.Register):
            return membership.register(env.peer, env.msg)
        if isinstance(env.msg, wire.Dead):
            membership.dead(env.peer, env.msg)
        return None

    server.start(on_message, on_peer_lost=membership.peer_lost)
    return Run(membership, pool, host, server, ctx, version)


@pytest.fixture
async def runs() -> AsyncIterator[list[Run]]:
    made: list[Run] = []
    yield made
    for run in made:
        for t in run.host.tasks:
            t.cancel()
        for m in run.members:
            await m.ep.aclose()
        await run.server.aclose()
        run.ctx.destroy(linger=0)


async def test_registration_answers_registered_or_a_refusal_naming_why(runs: list[Run]) -> None:
    runs.append(run := await start(elastic=False))
    run.version[0] = 4
    trainer = run.member("trainer", 0)
    reply = await trainer.register()
    assert isinstance(reply, wire.Registered)
    assert (reply.run_id, reply.policy_version) == ("run-1", 4)
    assert [(p.role, p.rank) for p in reply.peers] == [("trainer", 0)]
    assert run.pool.woken == 1
    other = run.member("rollout", 0)
    with pytest.raises(RemoteError, match="registration refused: no valid run token"):
        await other.register(token="b" * 64)
    with pytest.raises(RemoteError, match="registration refused: trainer-0 is already registered"):
        await other.ep.request(wire.Register(peer=trainer.info, token=TOKEN), timeout=5)
    assert not run.membership.all_registered()


async def test_wait_all_tells_the_trainers_and_brings_lagging_rollouts_up(runs: list[Run]) -> None:
    runs.append(run := await start(elastic=False, expected={"controller": 1, "trainer": 1, "rollout": 2}))
    run.version[0] = 3  # resumed: the trainer is at version 3
    trainer = run.member("trainer", 0)
    waiting = asyncio.create_task(run.membership.wait_all(10.0))
    await trainer.register()
    await run.member("rollout", 0, version=3).register()
    await asyncio.sleep(0.1)
    assert not waiting.done()  # one rollout is still missing
    await run.member("rollout", 1, version=1).register()
    await asyncio.wait_for(waiting, 5)
    peers = await trainer.next(wire.Peers)
    assert [p.rank for p in peers.peers] == [0, 1]
    sync = await trainer.next(wire.SyncWeights)
    assert [(p.role, p.rank) for p in sync.rollouts] == [("rollout", 1)]  # only the one behind


async def test_wait_all_names_what_did_not_register(runs: list[Run]) -> None:
    runs.append(run := await start(elastic=False))
    await run.member("trainer", 0).register()
    with pytest.raises(FatalError, match=r"did not register in 0\.3s: have \{.*'rollout': 0.*need"):
        await run.membership.wait_all(0.3)


async def test_a_rollout_joining_a_running_elastic_run_is_welcomed(runs: list[Run]) -> None:
    runs.append(run := await start(elastic=True))
    run.version[0] = 2
    trainer = run.member("trainer", 0)
    await trainer.register()
    await run.member("rollout", 0, version=2).register()
    await run.membership.wait_all(5.0)
    await trainer.next(wire.Peers)
    run.membership.open()
    reply = await run.member("rollout", 1000).register()  # a joiner's rank (runtime/launch/placement.py)
    assert isinstance(reply, wire.Registered) and reply.policy_version == 2
    peers = await trainer.next(wire.Peers)
    assert [p.rank for p in peers.peers] == [0, 1000]
    sync = await trainer.next(wire.SyncWeights)
    assert [p.rank for p in sync.rollouts] == [1000]


async def test_an_elastic_run_loses_a_dead_rollout_and_tells_the_trainers(runs: list[Run]) -> None:
    runs.append(run := await start(elastic=True, expected={"controller": 1, "trainer": 1, "rollout": 2}))
    trainer = run.member("trainer", 0)
    await trainer.register()
    rollouts = [run.member("rollout", r) for r in (0, 1)]
    for r in rollouts:
        await r.register()
    # A Dead for rollout-1 that rollout-0 sends is not believed.
    await rollouts[0].ep.send(wire.Dead(role="rollout", rank=1, cause="forged"))
    await asyncio.sleep(0.2)
    assert run.pool.lost == [] and run.membership.access.refused["dead"] == 1
    await rollouts[1].ep.send(wire.Dead(role="rollout", rank=1, cause="oom"))
    peers = await trainer.next(wire.Peers)
    assert [p.rank for p in peers.peers] == [0]
    assert run.pool.lost == ["rollout-1"] and run.host.failed == []
    run.membership.rollout_failed("rollout-0", "new weights could not be delivered")
    assert run.pool.lost == ["rollout-1", "rollout-0"]
    assert (await trainer.next(wire.Peers)).peers == []
    run.membership.rollout_failed("rollout-0", "again")  # no longer live: nothing happens
    assert run.pool.lost == ["rollout-1", "rollout-0"]


async def test_without_elastic_any_loss_ends_the_run(runs: list[Run]) -> None:
    runs.append(run := await start(elastic=False))
    trainer = run.member("trainer", 0)
    await trainer.register()
    rollout = run.member("rollout", 0)
    await rollout.register()
    await rollout.ep.send(wire.Dead(role="rollout", rank=0, cause="oom"))
    await asyncio.sleep(0.2)
    run.membership.rollout_failed("rollout-0", "unreachable")
    run.membership.peer_lost(b"trainer-0")
    assert run.host.failed == [
        "role rollout-0 died: oom", "rollout rollout-0: unreachable", "role trainer-0 went silent for 3s",
    ]  # fmt: skip
    assert run.pool.lost == []
    run.host.stopping = True
    run.membership.peer_lost(b"trainer-0")  # a stopping run ignores silences
    assert len(run.host.failed) == 3


async def test_an_elastic_run_without_rollouts_fails_after_the_grace(runs: list[Run]) -> None:
    runs.append(run := await start(elastic=True, grace_s=0.2))
    await run.member("rollout", 0).register()
    watch = asyncio.create_task(run.membership.watch_rollouts(poll_s=0.05))
    await asyncio.sleep(0.4)
    assert not watch.done()  # a rollout is there
    run.membership.peer_lost(b"rollout-0")
    assert run.pool.lost == ["rollout-0"]
    with pytest.raises(FatalError, match=r"no rollout worker for 0\.2s"):
        await asyncio.wait_for(watch, 5)
