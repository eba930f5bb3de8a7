"""The ranks of one SPMD role (trainer or critic), addressed as one.

Every request to the ranks goes out under the group's lock, to every rank in rank order,
so each rank receives the group's requests in the same order and runs its collectives in
the same order: two stages can never interleave a training step and a weight sync
differently on two ranks.
"""

from __future__ import annotations

import asyncio

from roles.controller.peers import Registry
from transport import wire
from transport.channels import RpcEndpoint


class RankGroup:
    def __init__(self, role: str, server: RpcEndpoint, registry: Registry) -> None:
        self.role = role
        self.server = server
        self.registry = registry
        self.lock = asyncio.Lock()

    def __len__(self) -> int:
        return self.registry.count(self.role)

    async def call(self, msgs: wire.Message | list[wire.Message], timeout: float) -> list[wire.Message]:
        """Send `msgs` (one for every rank, or one per rank in rank order) and return the
        replies in rank order; raises what the first failed request raised."""
        async with self.lock:
            peers = self.registry.of(self.role)
            per_rank = msgs if isinstance(msgs, list) else [msgs] * len(peers)
            if len(per_rank) != len(peers):
                raise ValueError(f"{len(per_rank)} requests for {len(peers)} {self.role} ranks")
            requests = [
                self.server.request(m, peer=p.identity, timeout=timeout) for m, p in zip(per_rank, peers, strict=True)
            ]
            return list(await asyncio.gather(*requests))
