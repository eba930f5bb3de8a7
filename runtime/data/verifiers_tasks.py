"""A verifiers (>= 0.4, `verifiers.v1`) environment as Tandem sees it, shared by the
controller (its tasks are the dataset), the rollout (its episodes) and the launch check.

`data.verifiers.id` names an installed taskset package (verifiers' `--env.taskset.id`),
`data.verifiers.args` its taskset config fields and `data.verifiers.env` the rest of
verifiers' env config (`--env.*`). `env_config(cfg)` is that config as verifiers builds it
(`resolve_env_config`: the taskset's and the env's own config classes), so a field the
environment does not know is refused as verifiers refuses it.

`unserved(cfg)` says, in one line, what of the environment Tandem cannot serve (None when
everything can be): every agent seat's model calls go to the rollout's endpoint, which
speaks the chat-completions dialect only; a harness that executes model-written code
must run in a container runtime, never on the host (Tandem's sandbox rule); a runtime
on another machine (prime, modal, e2b) cannot reach a rollout bound to this host; an
environment with several trainable seats makes several traces per episode where a
Tandem sample is one trajectory.
"""

from __future__ import annotations

from typing import Any

from runtime.config import VerifiersConfig

REMOTE_RUNTIMES = ("prime", "modal", "e2b")
CONTAINER_RUNTIMES = ("docker", "podman", "apptainer")


def env_config(cfg: VerifiersConfig) -> Any:
    """verifiers' env config; a seat whose runtime is not given runs in `subprocess` (this
    host: an in-process or tool-less harness needs nothing else; verifiers' own default is
    Prime's remote sandboxes, which cannot reach the rollout)."""
    from verifiers.v1 import resolve_env_config
    from verifiers.v1.configs.agent import agent_config_fields

    if not cfg.id:
        raise ValueError("data.source=verifiers needs data.verifiers.id (an installed verifiers environment)")
    raw = dict(cfg.env)
    raw["taskset"] = {**dict(raw.get("taskset") or {}), **cfg.args, "id": cfg.id}
    for seat in agent_config_fields(resolve_env_config(dict(raw))):
        given = dict(raw.get(seat) or {})
        given.setdefault("runtime", {"type": "subprocess"})
        raw[seat] = given
    return resolve_env_config(raw)


def load_taskset(cfg: VerifiersConfig) -> Any:
    from verifiers.v1 import load_taskset as vf_load_taskset

    return vf_load_taskset(env_config(cfg).taskset)


def task_messages(data: Any) -> list[dict[str, Any]]:
    """The task's opening messages (system prompt, then its prompt) as chat-completions dicts."""
    from verifiers.v1.dialects.chat import message_to_wire

    messages: list[dict[str, Any]] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        messages += [message_to_wire(m) for m in data.prompt]
    return messages


def unserved(cfg: VerifiersConfig) -> str | None:
    """What of the environment Tandem cannot serve (see the module docs), in one line."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import load_harness

    env = env_config(cfg)
    seats = agent_config_fields(env)
    harnesses = env.agent_harnesses()
    name = f"verifiers environment '{cfg.id}'"
    if len(seats) != 1:
        return f"{name} has {len(seats)} agent seats ({', '.join(seats)}); Tandem trains one trajectory per sample"
    for seat, spec in seats.items():
        runtime = str(getattr(spec.runtime, "type", "subprocess"))
        harness = load_harness(harnesses[seat])
        if runtime in REMOTE_RUNTIMES:
            return f"{name}: seat {seat} runs in the {runtime} runtime, which cannot reach this rollout's endpoint"
        if harness.EXECUTES_CODE and runtime not in CONTAINER_RUNTIMES:
            return (
                f"{name}: harness '{harnesses[seat].id}' executes model-written code, and the {runtime} runtime runs "
                f"it on this host; give it a container (data.verifiers.env.agent.runtime.type=docker)"
            )
    return None
