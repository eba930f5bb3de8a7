"""User functions named `module:function` (reward functions): loading them and checking,
before anything starts, that they can be called as the reward role calls them."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

REWARD_ARGUMENTS = ("prompt", "completion", "answer", "metadata", "prompt_ids", "completion_ids")


def load_function(spec: str) -> Callable[..., Any]:
    """Import `module:function`; a one-line ValueError names the part that failed."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward function '{spec}': cannot import '{module_name}' ({exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function '{spec}': '{attr}' is not a callable in {module_name}")
    return fn  # type: ignore[no-any-return]


def check_reward_signature(spec: str, fn: Callable[..., Any]) -> None:
    """A one-line ValueError when `fn` cannot be called with the reward arguments by
    keyword: a required parameter that is not one of REWARD_ARGUMENTS, or a positional-only one."""
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL):
            continue
        if p.kind is inspect.Parameter.POSITIONAL_ONLY or (name not in REWARD_ARGUMENTS and p.default is p.empty):
            raise ValueError(
                f"reward function '{spec}': parameter '{name}' is not one it can be given "
                f"({', '.join(REWARD_ARGUMENTS)}, by keyword)"
            )


def load_reward_function(spec: str) -> Callable[..., Any]:
    fn = load_function(spec)
    check_reward_signature(spec, fn)
    return fn
