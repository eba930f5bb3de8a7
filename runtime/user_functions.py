"""User functions named `module:function` (reward functions, multi-turn environment
factories, tools): loading them and checking, before anything starts, that they can be
called as the roles call them."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.errors import one_line

REWARD_ARGUMENTS = ("prompt", "completion", "answer", "metadata", "prompt_ids", "completion_ids")


def load_function(spec: str, what: str = "reward function") -> Callable[..., Any]:
    """Import `module:function`; a one-line ValueError names `what` and the part that failed."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} '{spec}' must be module:function")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        hint = _path_hint(module_name, exc.name)
        raise ValueError(f"{what} '{spec}': cannot import '{module_name}' ({exc}){hint}") from None
    except Exception as exc:  # the module itself raised: the traceback's last line is the cause
        raise ValueError(f"{what} '{spec}': importing '{module_name}' failed: {one_line(exc, line=-1)}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{what} '{spec}': '{attr}' is not a callable in {module_name}")
    return fn  # type: ignore[no-any-return]


def _path_hint(module_name: str, missing: str | None) -> str:
    """How to make `module_name` importable when it is the missing module (not one it imports)."""
    top = module_name.split(".")[0]
    if missing is not None and missing.split(".")[0] != top:
        return ""
    here = Path.cwd()
    if (here / f"{top}.py").is_file() or (here / top).is_dir():
        return f"; '{top}' is in the current directory, which is not on the import path: run with PYTHONPATH=."
    return "; put its directory on PYTHONPATH (or pip install it)"


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


def load_env_factory(spec: str) -> Callable[..., Any]:
    """The `rollout.env` factory: a callable that takes no argument or exactly one (the
    environment context); a one-line ValueError otherwise."""
    fn = load_function(spec, what="rollout.env")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return fn  # a builtin or C callable: trust it
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(required) > 1 or any(p.kind is p.KEYWORD_ONLY for p in required):
        raise ValueError(f"rollout.env '{spec}': the factory must take no argument or one (the EnvContext)")
    return fn


def env_factory_takes_context(fn: Callable[..., Any]) -> bool:
    """Whether the factory is called with the EnvContext (it has a positional parameter)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)
