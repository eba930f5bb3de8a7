"""An agent that owns its loop, written against the `openai` client as any agent is
(`rollout.agent: roles.rollout.example_agent:calculator_agent`, docs/ecosystem.md).

It asks the model with a `calculator` tool; while the reply calls tools it runs them
(Tandem's bounded calculator) and sends the results back as `tool` messages, up to
`MAX_ROUNDS` rounds; its reward is 1.0 when the last reply contains the row's `answer`.
Every call goes to the episode's `base_url`, so each is sampled and recorded by the run.
"""

from __future__ import annotations

import json
from typing import Any

from roles.rollout.agents import AgentTask
from roles.rollout.tools import calculator
from runtime.errors import one_line

MAX_ROUNDS = 2
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


async def calculator_agent(task: AgentTask) -> float:
    from openai import AsyncOpenAI

    messages: list[dict[str, Any]] = list(task.prompt)
    async with AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0) as client:
        for _ in range(MAX_ROUNDS + 1):
            reply = await client.chat.completions.create(model=task.model, messages=messages, tools=TOOLS)  # type: ignore[arg-type]
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": await _run(call)})
    last = str(messages[-1].get("content") or "")
    return 1.0 if task.answer is not None and str(task.answer) in last else 0.0


async def _run(call: Any) -> str:
    try:
        args = json.loads(call.function.arguments or "{}")
        return str(calculator(**args)) if call.function.name == "calculator" else "error: unknown tool"
    except Exception as exc:  # the model's bad call is something it reads, not a crash
        return f"error: {one_line(exc)}"
