"""SleepBeforeStep: in a synchronous run, rollouts that share a GPU with a trainer rank sleep before
each training step, so the trainer steps with their memory.

What a caller may rely on:
* `SleepBeforeStep.__call__(version)` sends `wire.SleepBeforeStep(version)` to every live rollout that said at
  registration that it sleeps (`capabilities["sleeps"]`) and returns once each has
  answered (asleep, or why it stays awake) or `timeout_s` has passed. A rollout that fails
  or does not answer in time is logged (throttled) and the step goes on: its trainer may
  find less memory, and a rollout that died is reported by its membership as always.
* It returns at once when no live rollout sleeps (split placement, async runs never call it).
"""

from __future__ import annotations

import asyncio

from roles.controller.peers import Peer, Registry
from runtime.errors import one_line
from runtime.logs import get_logger
from transport import wire
from transport.rpc import RpcEndpoint
from transport.throttle import Throttled

log = get_logger("controller")


class SleepBeforeStep:
    def __init__(self, server: RpcEndpoint, registry: Registry, *, timeout_s: float) -> None:
        self.server = server
        self.registry = registry
        self.timeout_s = timeout_s
        self.noisy = Throttled(log)

    async def __call__(self, version: int) -> dict[str, str]:
        """Each sleeping rollout's answer (its `Ack.info`, or the failure) by name."""
        peers = [p for p in self.registry.of("rollout") if p.info.capabilities.get("sleeps")]
        answers = await asyncio.gather(*(self._ask(p, version) for p in peers))
        return dict(zip((p.name for p in peers), answers, strict=True))

    async def _ask(self, peer: Peer, version: int) -> str:
        try:
            reply = await self.server.request(
                wire.SleepBeforeStep(version=version), peer=peer.identity, timeout=self.timeout_s
            )
        except Exception as exc:  # a timeout, a dead peer, an error reply: the step goes on
            self.noisy.warning("sleep_before_step_failed", key=peer.name, rollout=peer.name, error=one_line(exc))
            return f"failed: {exc}"
        return reply.info if isinstance(reply, wire.Ack) else f"unexpected reply {type(reply).__name__}"
