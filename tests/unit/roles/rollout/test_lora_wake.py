"""An adapter update on a sleeping LoRA engine (roles/generation/engine.py) wakes vLLM's weights
before it registers the adapter: vLLM's LoRA slots are allocated with its weights and sleep with
them, so an adapter written while they sleep lands in unmapped memory (the wake failure seen on
a GPU; `sleep_when_idle` with LoRA stays refused at launch until a GPU run verifies this). A
recording engine stands in for vLLM (no vLLM needed)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from roles.generation.engine import LoraServing, RolloutEngine
from runtime.config import EngineConfig


class RecordingEngine:
    errored = False

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep {level}")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"wake_up {','.join(tags or [])}")

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.calls.append(str(method))
        return [{}]


def test_an_adapter_update_wakes_the_weights_before_registering(tmp_path: Path) -> None:
    lora = LoraServing(max_rank=16, max_loras=2, config={}, adapters_dir=tmp_path)
    engine = RolloutEngine(EngineConfig(call_timeout_s=5.0), "unused", sleep_mode=True, lora=lora)
    vllm = RecordingEngine()
    engine.engine = vllm

    async def go() -> None:
        assert await engine.sleep(5.0, level=1)
        await engine.begin_update(1, 5.0)
        await engine.finish_update(5.0)

    asyncio.run(go())
    begin = next(i for i, c in enumerate(vllm.calls) if "begin" in c.lower())
    assert vllm.calls[:2] == ["sleep 1", "wake_up weights"] and begin == 2, vllm.calls
    assert engine.version == 1 and engine._asleep == {"kv_cache"}  # the KV cache wakes for the next request
