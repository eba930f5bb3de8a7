"""Tools for multi-turn environments: Hermes / Qwen2.5 tool-call parsing, a registry of
Python tools (`rollout.tools: [module:function]`), and the built-in calculator.

What a caller may rely on:
* `parse_tool_calls(text)` finds every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  in order; a block that is not such JSON (or is never closed) comes back as a call with
  a one-line `error` instead of being skipped, so the model hears about it.
* `ToolRegistry.call(name, arguments)` never raises (cancellation aside): an unknown
  tool, arguments the function does not take, a raise, a result that is not text or
  JSON, or a call over `timeout_s` all come back as a `ToolResult` with `ok=False` and a
  one-line message for the model. A sync tool runs in a daemon thread of its own; one
  that hangs is abandoned at the timeout, not killed (untrusted code belongs in a
  subprocess: roles/rollout/sandbox.py).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import json
import operator
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.errors import one_line
from runtime.user_functions import load_function

MAX_RESULT_CHARS = 4000  # longer tool output is cut (it becomes prompt tokens)
_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # why the block is not a valid call ("" when it is)


@dataclass(frozen=True)
class ToolResult:
    text: str
    ok: bool


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>` block of `text`, in order (see the module docs)."""
    calls = []
    for m in _CALL.finditer(text):
        body, closed = m.group(1).strip(), bool(m.group(2))
        calls.append(_parse_one(body) if closed else ToolCall("", error="tool call not closed with </tool_call>"))
    return calls


def _parse_one(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except ValueError as exc:
        return ToolCall("", error=f"tool call is not valid JSON ({exc})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", error='tool call must be a JSON object with a "name" string')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some templates send the arguments JSON-encoded
        try:
            args = json.loads(args)
        except ValueError:
            pass
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error=f'tool call "arguments" must be a JSON object, got {type(args).__name__}')
    return ToolCall(obj["name"], args)


class ToolRegistry:
    """Python tools by name, each call bounded by `timeout_s`."""

    def __init__(self, specs: list[str], timeout_s: float) -> None:
        """Load every `module:function` (a one-line ValueError naming a bad one). The
        tool's name is the function's attribute name."""
        self.timeout_s = timeout_s
        self.tools: dict[str, Callable[..., Any]] = {}
        for spec in specs:
            self.tools[spec.partition(":")[2]] = load_function(spec, what="rollout.tools entry")

    @property
    def names(self) -> list[str]:
        return sorted(self.tools)

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        fn = self.tools.get(name)
        if fn is None:
            return ToolResult(f"error: unknown tool '{name}' (available: {', '.join(self.names) or 'none'})", False)
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError as exc:
            return ToolResult(f"error: bad arguments for tool '{name}': {exc}", False)
        try:
            async with asyncio.timeout(self.timeout_s):
                result = await fn(**arguments) if inspect.iscoroutinefunction(fn) else await _in_thread(fn, arguments)
        except TimeoutError:
            return ToolResult(f"error: tool '{name}' did not return in {self.timeout_s:g}s", False)
        except Exception as exc:
            return ToolResult(f"error: tool '{name}' raised {one_line(exc)}", False)
        return _as_text(name, result)

    async def run(self, call: ToolCall) -> ToolResult:
        """A parsed call: its parse error, or the tool's result."""
        if call.error:
            return ToolResult(f"error: {call.error}", False)
        return await self.call(call.name, call.arguments)


async def _in_thread(fn: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    """`fn(**arguments)` in a daemon thread of its own: one that hangs holds only that
    thread (never a slot of the loop's shared executor, nor the process at exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # the call was abandoned (timeout)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def run() -> None:
        try:
            value, error = fn(**arguments), None
        except BaseException as exc:  # handed to the awaiting task, which turns it into an error result
            value, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed while the tool ran
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=run, name=f"tool-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return await future


def _as_text(name: str, result: Any) -> ToolResult:
    if isinstance(result, str):
        text = result
    else:
        try:
            text = json.dumps(result)
        except (TypeError, ValueError):
            return ToolResult(f"error: tool '{name}' returned {type(result).__name__}, not text or JSON", False)
    return ToolResult(text[:MAX_RESULT_CHARS], True)


# --- the built-in calculator --------------------------------------------------------------

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30


def calculator(expression: str) -> str:
    """Evaluate arithmetic (+ - * / // % **, parentheses, numbers); raises ValueError on
    anything else, on exponents over MAX_EXPONENT and results over MAX_MAGNITUDE."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _eval(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _eval(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))  # type: ignore[no-any-return]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is over {MAX_EXPONENT}")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex):
            raise ValueError("result is not a real number")
        if abs(value) > MAX_MAGNITUDE:
            raise ValueError("result too large")
        return value  # type: ignore[no-any-return]
    raise ValueError(f"unsupported in arithmetic: {ast.unparse(node)!r}")
