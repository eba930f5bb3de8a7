"""Agents for the endpoint tests: the openai client, a tool in every request, replies' ids kept."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from roles.rollout.agents import AgentTask
from roles.rollout.example_agent import TOOLS

REPLIES: dict[str, list[list[int]]] = {}  # episode id -> each reply's token_ids, as the endpoint returned them


async def two_calls(task: AgentTask) -> float:
    """Two chat calls with the calculator tool offered; tool results go back when called."""
    from openai import AsyncOpenAI

    messages: list[dict[str, Any]] = [*task.prompt] or [{"role": "user", "content": "hi"}]
    got = REPLIES.setdefault(task.episode_id, [])
    async with AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0) as client:
        for _ in range(2):
            reply = await client.chat.completions.create(model=task.model, messages=messages, tools=TOOLS)  # type: ignore[arg-type]
            choice = reply.choices[0]
            got.append(list(choice.model_extra["token_ids"]))
            messages.append(choice.message.model_dump(exclude_none=True))
            for call in choice.message.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
            messages.append({"role": "user", "content": "again"})
    out = os.environ.get("TANDEM_TEST_REPLIES")
    if out:
        with Path(out).open("a") as f:
            f.write(json.dumps({"episode": task.episode_id, "replies": got}) + "\n")
    return 0.5
