"""Every call of the rollout's engine wrapper (roles/generation/engine.py) into vLLM is
bounded by `rollout.engine.call_timeout_s`, the ones a hung engine used to hold forever
included: `abort_all`, `checksum`, `checksums` and the device query. A fake engine that
never answers stands in for vLLM (no vLLM needed)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from roles.generation.engine import RolloutEngine, _Active
from runtime.config import EngineConfig


class HungEngine:
    errored = False

    async def abort(self, ids: Any) -> None:
        await asyncio.sleep(3600)

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        await asyncio.sleep(3600)
        return []


@pytest.mark.parametrize("call", ["abort_all", "checksum", "checksums", "device"])
def test_a_hung_engine_call_fails_at_call_timeout_s(call: str) -> None:
    engine = RolloutEngine(EngineConfig(call_timeout_s=0.2), "unused")
    engine.engine = HungEngine()
    engine._active["v1"] = _Active.__new__(_Active)  # one active sample for abort_all to abort

    async def go() -> None:
        await getattr(engine, call)()

    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not return in 0\.2s"):
        asyncio.run(go())
    assert time.monotonic() - started < 2
