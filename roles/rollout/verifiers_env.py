"""A verifiers environment (`data.source: verifiers`) run unchanged as the rollout's agent.

For each sample, the task the controller drew (`metadata.verifiers_task`, its data as the
taskset made it) is rebuilt as the taskset's own Task and played by verifiers' own
`Env.run_episode`: its harness (the multi-turn logic), its interception hooks, stop
conditions and limits, its rubric (`@vf.reward` functions with their weights, judges).
The one change is where model calls go: every seat's client is the rollout's
OpenAI-compatible endpoint for this episode (runtime/data/verifiers_tasks.py refuses at launch
what could not go there), so each call is sampled by the rollout's engine and recorded
token-exact in the episode (roles/rollout/agent_episode.py). The episode's reward is the
weighted sum of its traces' rewards (verifiers' `Trace.reward`).

What a caller may rely on: an episode that verifiers reports failed (`Episode.ok` false:
a harness, task or hook error, a verifiers timeout) raises one line naming its first
error, so the sample is an error and its group is dropped, as a failed `rollout.env`
sample is. The environment's serving resources (shared tool servers, the interception
server) live from `start` to `aclose`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from runtime.config import VerifiersConfig
from runtime.data.verifiers_tasks import env_config

KEY_VAR = "TANDEM_OPENAI_API_KEY"  # verifiers' clients read their key from a variable


class VerifiersAgent:
    def __init__(self, env: Any, stack: contextlib.AsyncExitStack) -> None:
        self.env = env
        self.stack = stack
        self.task_cls = type(env.taskset).task_type()

    @classmethod
    async def start(cls, cfg: VerifiersConfig) -> VerifiersAgent:
        from verifiers.v1 import load_environment

        env = load_environment(env_config(cfg))
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(env.serving())
        return cls(env, stack)

    async def __call__(self, task: Any) -> float:  # a roles.rollout.agents.AgentTask (agents.py imports this)
        from verifiers.v1 import EvalClientConfig, ModelContext

        os.environ[KEY_VAR] = task.api_key
        data = self.task_cls.data_type().model_validate(task.metadata["verifiers_task"])
        vtask = self.task_cls(data, self.env.taskset.config.task)
        client = EvalClientConfig(base_url=task.base_url, api_key_var=KEY_VAR)
        episode = await self.env.run_episode(vtask, ModelContext(model=task.model, client=client))
        if not episode.ok:
            raise RuntimeError(f"verifiers episode failed: {_first_error(episode)}")
        return float(sum(trace.reward for trace in episode.traces))

    async def aclose(self) -> None:
        await self.stack.aclose()


def _first_error(episode: Any) -> str:
    errors = list(episode.errors) + [e for trace in episode.traces for e in trace.errors]
    if not errors:
        return "no trace concluded"
    first = errors[0]
    return " ".join(f"{first.type}: {first.message}".split())[:400]
