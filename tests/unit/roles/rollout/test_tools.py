"""Tool calls of multi-turn rollouts: Hermes / Qwen2.5 parsing, the registry's bounds
(every failure becomes an error result, never a raise), the calculator, and the built-in
tool environment's observations."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from roles.rollout.environment import Turn
from roles.rollout.tool_env import ToolEnv
from roles.rollout.tools import MAX_RESULT_CHARS, ToolCall, ToolRegistry, ToolResult, calculator, parse_tool_calls

HERE = __name__
_NEVER = threading.Event()


def add(a: int, b: int) -> int:
    return a + b


async def echo(text: str) -> str:
    await asyncio.sleep(0)
    return text


def boom() -> str:
    raise RuntimeError("tool broke")


def hang_sync() -> str:
    _NEVER.wait(5.0)
    return "late"


async def hang_async() -> str:
    await asyncio.sleep(3600)
    return "never"


def garbage() -> object:
    return object()


def huge() -> str:
    return "x" * (MAX_RESULT_CHARS + 100)


def registry(timeout_s: float = 0.2) -> ToolRegistry:
    names = ["add", "echo", "boom", "hang_sync", "hang_async", "garbage", "huge"]
    return ToolRegistry([f"{HERE}:{n}" for n in names] + ["roles.rollout.tools:calculator"], timeout_s)


def call(name: str, **arguments: Any) -> ToolResult:
    return asyncio.run(registry().call(name, arguments))


def test_parse_valid_calls_in_order() -> None:
    text = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>'
    )
    assert parse_tool_calls(text) == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("calculator", {"expression": "2*3"})]
    assert parse_tool_calls("no calls here") == []
    assert parse_tool_calls('<tool_call>{"name": "boom"}</tool_call>') == [ToolCall("boom", {})]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>{not json}</tool_call>", "tool call is not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'tool call must be a JSON object with a "name" string'),
        ('<tool_call>["add"]</tool_call>', 'tool call must be a JSON object with a "name" string'),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', '"arguments" must be a JSON object, got list'),
        ('<tool_call>{"name": "add", "arguments": {"a": 1', "tool call not closed with </tool_call>"),
    ],
)
def test_malformed_calls_are_reported_not_skipped(text: str, error: str) -> None:
    (parsed,) = parse_tool_calls(text)
    assert error in parsed.error
    result = asyncio.run(registry().run(parsed))
    assert not result.ok and result.text.startswith("error: ") and error in result.text


def test_sync_and_async_tools_return_text_or_json() -> None:
    assert call("add", a=2, b=3) == ToolResult("5", True)
    assert call("echo", text="hi") == ToolResult("hi", True)
    assert call("calculator", expression="(2 + 3) * 4 / 8") == ToolResult("2.5", True)
    assert call("huge") == ToolResult("x" * MAX_RESULT_CHARS, True)


@pytest.mark.parametrize(
    ("name", "arguments", "error"),
    [
        ("nope", {}, "error: unknown tool 'nope' (available: add, boom, calculator, echo, garbage, hang_async"),
        ("add", {"a": 1}, "error: bad arguments for tool 'add': missing a required argument: 'b'"),
        ("add", {"a": 1, "b": 2, "c": 3}, "error: bad arguments for tool 'add'"),
        ("boom", {}, "error: tool 'boom' raised RuntimeError: tool broke"),
        ("hang_sync", {}, "error: tool 'hang_sync' did not return in 0.2s"),
        ("hang_async", {}, "error: tool 'hang_async' did not return in 0.2s"),
        ("garbage", {}, "error: tool 'garbage' returned object, not text or JSON"),
        ("calculator", {"expression": "__import__('os')"}, "error: tool 'calculator' raised ValueError: unsupported"),
    ],
)
def test_every_tool_failure_is_an_error_result(name: str, arguments: dict[str, Any], error: str) -> None:
    started = time.monotonic()
    result = call(name, **arguments)
    assert not result.ok and result.text.startswith(error), result.text
    assert time.monotonic() - started < 2.0  # a hanging tool is cut at the timeout


def test_a_bad_tool_spec_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"rollout.tools entry 'no_such_mod_q:f': cannot import"):
        ToolRegistry(["no_such_mod_q:f"], 1.0)
    with pytest.raises(ValueError, match=r"rollout.tools entry 'calculator' must be module:function"):
        ToolRegistry(["calculator"], 1.0)


@pytest.mark.parametrize(
    ("expression", "value"), [("1+2*3", "7"), ("-4 // 3", "-2"), ("2 ** 10", "1024"), ("7 % 4", "3"), ("1/4", "0.25")]
)
def test_calculator(expression: str, value: str) -> None:
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("2 ** 1000", "exponent 1000 is over"),
        ("10 ** 40", "result too large"),
        ("x + 1", "unsupported in arithmetic"),
        ("1 +", "not an arithmetic expression"),
        ("(-8) ** 0.5", "not a real number"),
    ],
)
def test_calculator_refuses(expression: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        calculator(expression)


def test_tool_env_answers_calls_in_qwen_format_and_ends_on_a_turn_without_calls() -> None:
    env = ToolEnv(registry())
    text = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><tool_call>{"name": "x"}</tool_call>'
    step = asyncio.run(env.step(Turn(0, [], text + "<|im_end|>", "stop")))
    assert step.observation == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n"
        "error: unknown tool 'x' (available: add, boom, calculator, echo, garbage, hang_async, hang_sync, huge)"
        "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert not step.done and (env.num_calls, env.num_errors) == (2, 1)
    cut = asyncio.run(env.step(Turn(1, [], text, "length")))  # a turn cut by length gets its end tag
    assert isinstance(cut.observation, str) and cut.observation.startswith("<|im_end|>\n<|im_start|>user\n")
    last = asyncio.run(env.step(Turn(2, [], "The answer is 3.<|im_end|>", "stop")))
    assert last.done and last.observation is None and last.reward is None
