"""Agents for the endpoint tests: the openai client, a tool in every request, replies' ids kept
(`TANDEM_TEST_REPLIES`: a file each episode's replies are appended to, one JSON line)."""

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
    _record(task, got)
    return 0.5


# A strict tool whose one argument is an enum: vLLM's tool-call grammar (tool_choice "required"
# or named) then pins the call's JSON, so even the tiny random model makes a valid call in
# about 100 tokens (the grammar lets it add JSON whitespace, 1 in 5 or so at each gap).
CALCULATOR = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "enum": ["6*7", "2+2"]}},
                "required": ["expression"],
                "additionalProperties": False,
            },
        },
    }
]
ROUNDS: dict[str, list[dict[str, Any]]] = {}  # episode id -> each reply: token_ids, prompt_token_ids, tool_calls


async def tool_round(task: AgentTask, tool_choice: Any = "required") -> float:
    """One tool round on the openai client: the model must call the calculator, the agent
    runs it and sends the result as a `tool` message, the model answers (tool_choice "none").
    Reward 1.0 when the calculator said 42 (the model chose "6*7"), else 0.0: the group's
    rewards differ, so its steps train. A forced call that comes back unparsed raises."""
    from openai import AsyncOpenAI

    from roles.rollout.tools import calculator

    messages: list[dict[str, Any]] = [*task.prompt] or [{"role": "user", "content": "hi"}]
    got = ROUNDS.setdefault(task.episode_id, [])
    results: list[str] = []
    async with AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0) as client:
        for choice, limit in ((tool_choice, None), ("none", 8)):
            reply = await client.chat.completions.create(
                model=task.model, messages=messages, tools=CALCULATOR, tool_choice=choice, max_tokens=limit,  # type: ignore[arg-type]
                parallel_tool_calls=False,
            )  # fmt: skip
            message = reply.choices[0].message
            extra = {**(reply.model_extra or {}), **(reply.choices[0].model_extra or {})}
            got.append({**extra, "finish_reason": reply.choices[0].finish_reason, "message": message.model_dump()})
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or []:
                results.append(calculator(**json.loads(call.function.arguments)))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": results[-1]})
            if choice != "none" and not results:
                raise RuntimeError(f"tool_choice {choice!r} gave no parsed call: {message.content!r}")
    _record(task, got)
    return 1.0 if results == ["42"] else 0.0


async def named_tool_round(task: AgentTask) -> float:
    """`tool_round` with the calculator named in tool_choice."""
    return await tool_round(task, {"type": "function", "function": {"name": "calculator"}})


def _record(task: AgentTask, replies: list[Any]) -> None:
    out = os.environ.get("TANDEM_TEST_REPLIES")
    if out:
        with Path(out).open("a") as f:
            f.write(json.dumps({"episode": task.episode_id, "replies": replies}) + "\n")


def record_sample(completion_ids: list[int], **_: object) -> float:
    """A reward function that adds nothing and appends the sample's ids, as the controller
    holds them for training, to the file `TANDEM_TEST_SCORED` names (one JSON line each)."""
    with Path(os.environ["TANDEM_TEST_SCORED"]).open("a") as f:
        f.write(json.dumps(completion_ids) + "\n")
    return 0.0
