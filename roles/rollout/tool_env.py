"""The built-in tool-using environment (`rollout.env: roles.rollout.tool_env:factory`).

Each assistant turn is searched for Hermes / Qwen2.5 `<tool_call>` blocks. A turn with
none ends the sample (the reward functions score the whole trajectory). Otherwise every
call runs (concurrently, each bounded by `rollout.tool_timeout_s`) and the results go
back in Qwen2.5's chat format, one `<tool_response>` block per call in a user turn,
followed by the next assistant header:

    <|im_end|>            (only when the turn did not end with it)
    \\n<|im_start|>user\\n<tool_response>\\nRESULT\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

An invalid call (malformed JSON, unknown tool, bad arguments) or a failing tool gets
an `error: ...` result in its place: the model hears about it and the sample goes on.
The environment gives no reward of its own.
"""

from __future__ import annotations

import asyncio

from roles.rollout.environment import EnvContext, Step, Turn
from roles.rollout.tools import ToolRegistry, ToolResult, parse_tool_calls

END, START = "<|im_end|>", "<|im_start|>"


class ToolEnv:
    def __init__(self, tools: ToolRegistry) -> None:
        self.tools = tools
        self.num_calls = 0
        self.num_errors = 0

    async def step(self, turn: Turn) -> Step:
        calls = parse_tool_calls(turn.text)
        if not calls:
            return Step(done=True)
        results = await asyncio.gather(*(self.tools.run(c) for c in calls))
        self.num_calls += len(results)
        self.num_errors += sum(not r.ok for r in results)
        return Step(observation=observation(turn.text, results))


def observation(turn_text: str, results: list[ToolResult]) -> str:
    """The text that follows a turn with tool calls (see the module docs)."""
    close = "" if turn_text.rstrip().endswith(END) else END
    body = "\n".join(f"<tool_response>\n{r.text}\n</tool_response>" for r in results)
    return f"{close}\n{START}user\n{body}{END}\n{START}assistant\n"


def factory(context: EnvContext) -> ToolEnv:
    return ToolEnv(context.tools)
