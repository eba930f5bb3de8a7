"""Launch checks of what comes from other projects: reasoning-gym tasks, verifiers
environments, math-verify rewards and agents with their own loop (docs/ecosystem.md).

`check_ecosystem(cfg)` raises `ConfigError` in one line, before anything starts: a recipe
that needs an optional extra that is not installed names the extra and the command that
installs it; a verifiers environment Tandem cannot serve says what (runtime/data/verifiers_tasks.py);
settings that contradict each other name both keys.
"""

from __future__ import annotations

import importlib
import importlib.util

from runtime.config import RunConfig
from runtime.errors import ConfigError, one_line

# package to import -> the extra of pyproject.toml that installs it
EXTRAS = {
    "reasoning_gym": "reasoning-gym",
    "verifiers": "verifiers",
    "math_verify": "math",
    "openai": "openai-endpoint",
}
# Tandem modules that need one
MODULE_NEEDS = {"roles.reward.reasoning_gym": "reasoning_gym", "roles.reward.math_verify": "math_verify"}


def missing_extra(package: str, what: str) -> ConfigError | None:
    if importlib.util.find_spec(package) is not None:
        return None
    extra = EXTRAS[package]
    return ConfigError(
        f"{what} needs the {extra} extra (the {package} package is not installed): "
        f".venv/bin/python -m pip install -e '.[{extra}]'"
    )


def check_ecosystem(cfg: RunConfig) -> None:
    d, r = cfg.data, cfg.rollout
    needs: list[tuple[str, str]] = []
    if d.source in ("reasoning_gym", "verifiers"):
        needs.append((d.source, f"data.source={d.source}"))
    for spec in cfg.reward.functions:
        module = spec.partition(":")[0]
        if module in MODULE_NEEDS:
            needs.append((MODULE_NEEDS[module], f"reward function '{spec}'"))
    for package, what in needs:
        if (err := missing_extra(package, what)) is not None:
            raise err
    if r.agent:
        _check_agent_imports(r.agent)
    agent = bool(r.agent) or d.source == "verifiers"
    if r.agent and d.source == "verifiers":
        raise ConfigError(
            "rollout.agent is set but data.source=verifiers brings its own agent: leave rollout.agent empty"
        )
    if agent and r.env:
        raise ConfigError(f"rollout.env and {_agent_key(cfg)} both drive the episodes: keep one")
    if not d.render_prompt and not agent:
        raise ConfigError("data.render_prompt=false needs an agent that renders the prompt (rollout.agent)")
    if d.source == "verifiers" and d.render_prompt:
        raise ConfigError("data.source=verifiers: its harness renders the prompt; set data.render_prompt=false")
    if agent:
        budget = r.max_total_tokens or r.max_turns * r.max_tokens
        if budget >= r.engine.max_model_len:
            raise ConfigError(
                f"rollout.max_total_tokens ({budget}{'' if r.max_total_tokens else ' = max_turns * max_tokens'}) "
                f"must be below rollout.engine.max_model_len ({r.engine.max_model_len})"
            )
    if d.source == "reasoning_gym":
        _check_reasoning_gym(cfg)
    if d.source == "verifiers":
        _check_verifiers(cfg)


def _agent_key(cfg: RunConfig) -> str:
    return "rollout.agent" if cfg.rollout.agent else "data.source=verifiers"


def _check_agent_imports(spec: str) -> None:
    from runtime.user_functions import load_function

    module = spec.partition(":")[0]
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top in EXTRAS and (err := missing_extra(top, f"rollout.agent '{spec}'")) is not None:
            raise err from None
    except Exception:
        pass  # load_function below says what failed
    try:
        load_function(spec, what="rollout.agent")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_reasoning_gym(cfg: RunConfig) -> None:
    rg = cfg.data.reasoning_gym
    if not rg.task:
        raise ConfigError("data.source=reasoning_gym needs data.reasoning_gym.task (a reasoning-gym dataset name)")
    from runtime.data.task_sources import ReasoningGymRows

    try:
        ReasoningGymRows(cfg.data, cfg.seed)[0]
    except Exception as exc:
        raise ConfigError(f"data.reasoning_gym (task '{rg.task}'): {_one_line(exc)}") from None


def _check_verifiers(cfg: RunConfig) -> None:
    from runtime.data.verifiers_tasks import unserved

    try:
        why = unserved(cfg.data.verifiers)
    except Exception as exc:
        raise ConfigError(f"data.verifiers (environment '{cfg.data.verifiers.id}'): {_one_line(exc)}") from None
    if why is not None:
        raise ConfigError(why)


def _one_line(exc: BaseException) -> str:
    return one_line(exc, 400, line=0)
