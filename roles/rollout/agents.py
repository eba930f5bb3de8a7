"""Agents that own their loop (`rollout.agent: module:function`, or a verifiers environment):
one episode per sample, driven through the rollout's OpenAI-compatible endpoint.

For each sample the rollout opens an episode on its endpoint (roles/rollout/openai_server.py)
and calls the agent function with an `AgentTask`: the episode's `base_url` and `api_key`
for the `openai` client, the dataset row (`prompt` messages, `answer`, `metadata`). The
function's return is the episode's end: a number is its reward (as does a
`POST {episode_url}/reward` before it returns; the last one reported counts), None leaves
the reward to `reward.functions`. The sample is the episode's trajectory
(roles/rollout/agent_episode.py) sent back as one `wire.Completion` with its loss mask and
the reward as `env_reward`.

What a caller may rely on: `AgentRunner.complete` never raises for the agent's faults: an
agent that raises, returns a value that is not a number, makes no call or overruns
`rollout.request_timeout_s` gives a sample with finish ERROR and a one-line error (its
group is dropped, as any errored group is). A sync function runs in a thread.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from roles.generation.engine import RolloutEngine, Sample
from roles.rollout.agent_episode import AgentEpisode
from roles.rollout.episode import Trajectory, turn_sampling
from roles.rollout.multiturn import completion
from roles.rollout.openai_server import EndpointServer
from runtime.config import RolloutConfig
from runtime.errors import TandemError, one_line
from transport import wire

AgentFn = Callable[["AgentTask"], Awaitable[Any] | Any]


@dataclass(frozen=True)
class AgentTask:
    """What an agent gets for one episode."""

    episode_id: str
    base_url: str  # for the openai client: {episode_url}/v1
    api_key: str
    episode_url: str  # POST {episode_url}/reward {"reward": x} reports the reward
    model: str
    prompt: list[dict[str, Any]]  # the dataset prompt as chat messages (data.render_prompt=false)
    prompt_text: str  # the prompt as the controller rendered it ("" with data.render_prompt=false)
    answer: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    sample_index: int = 0

    def environ(self) -> dict[str, str]:
        """The variables an agent process reads: OPENAI_BASE_URL, OPENAI_API_KEY (what the
        `openai` SDK picks up by itself), TANDEM_EPISODE_URL and TANDEM_TASK (JSON of the row)."""
        row = {"prompt": self.prompt, "prompt_text": self.prompt_text, "answer": self.answer, "metadata": self.metadata}
        return {
            "OPENAI_BASE_URL": self.base_url,
            "OPENAI_API_KEY": self.api_key,
            "TANDEM_EPISODE_URL": self.episode_url,
            "TANDEM_MODEL": self.model,
            "TANDEM_TASK": json.dumps(row, default=str),
        }


class AgentFailed(TandemError, RuntimeError):
    """The agent raised, overran its bound or returned something that is not a reward."""


class AgentRunner:
    def __init__(self, cfg: RolloutConfig, server: EndpointServer, agent: AgentFn, tokenizer: Any) -> None:
        self.cfg = cfg
        self.server = server
        self.agent = agent
        self.tokenizer = tokenizer

    async def complete(self, engine: RolloutEngine, req: wire.Generate, index: int) -> wire.Completion:
        started = time.perf_counter()
        deadline = time.monotonic() + self.cfg.request_timeout_s
        max_tokens = req.sampling.max_tokens

        async def sample(context: list[int], limit: int, call: int, structured: Any) -> Sample:
            spec = turn_sampling(req.sampling, limit, call)
            left = max(1e-3, deadline - time.monotonic())
            rid = f"{req.request_id}.c{call}"
            return await engine.generate(rid, context, spec, index, timeout_s=left, structured=structured)

        episode_id = f"{req.request_id}-{index}-{secrets.token_hex(4)}"
        budget = self.cfg.max_total_tokens or self.cfg.max_turns * max_tokens
        ep = AgentEpisode(episode_id, list(req.prompt_ids), sample, budget, self.cfg.max_turns, max_tokens)
        self.server.episodes[episode_id] = ep
        try:
            await self._drive(ep, self._task(ep, req, index), deadline)
            traj = ep.result(engine.version)
            if not ep.calls and not traj.error:
                traj = Trajectory(finish_reason=wire.FinishReason.ERROR, error="the agent made no model call")
        except AgentFailed as exc:
            traj = Trajectory(finish_reason=wire.FinishReason.ERROR, error=str(exc))
        finally:
            ep.finished = True
            self.server.episodes.pop(episode_id, None)
        return completion(req, index, traj, time.perf_counter() - started)

    async def _drive(self, ep: AgentEpisode, task: AgentTask, deadline: float) -> None:
        """Run the agent to its end; its return (a number, or None) is the reward."""
        left = max(1e-3, deadline - time.monotonic())
        try:
            result = self.agent(task)
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(result, left)
        except TimeoutError:
            raise AgentFailed(
                f"the agent did not finish in {self.cfg.request_timeout_s:g}s (rollout.request_timeout_s)"
            ) from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise AgentFailed(f"the agent raised {one_line(exc)}") from None
        if result is None:
            return
        if isinstance(result, bool) or not isinstance(result, int | float) or not math.isfinite(result):
            raise AgentFailed(f"the agent returned {type(result).__name__} {str(result)[:60]!r}, not a finite reward")
        ep.report(float(result))

    async def close(self) -> None:
        """Stop the endpoint and the agent's own resources (a verifiers environment's)."""
        aclose = getattr(self.agent, "aclose", None)
        try:
            if aclose is not None:
                await aclose()
        finally:
            await self.server.close()

    def _task(self, ep: AgentEpisode, req: wire.Generate, index: int) -> AgentTask:
        meta = dict(req.metadata)
        prompt = meta.pop("prompt", None) if not req.prompt_ids else None
        text = self.tokenizer.decode(req.prompt_ids, skip_special_tokens=False) if req.prompt_ids else ""
        url = self.server.episode_url(ep.episode_id)
        return AgentTask(
            episode_id=ep.episode_id,
            base_url=f"{url}/v1",
            api_key=self.server.key,
            episode_url=url,
            model=self.server.model,
            prompt=list(prompt or []),
            prompt_text=text,
            answer=req.answer,
            metadata=meta,
            sample_index=index,
        )


def sync_agent(fn: Callable[[AgentTask], Any]) -> AgentFn:
    """A sync agent function run in a thread of its own (so its blocking calls to the
    endpoint do not block the rollout's event loop, which serves them)."""

    async def run(task: AgentTask) -> Any:
        return await asyncio.to_thread(fn, task)

    return run


def serves_agents(cfg: Any) -> bool:
    """Whether the run's rollouts serve the endpoint: agents drive their episodes over it."""
    return bool(cfg.rollout.agent or cfg.data.source == "verifiers")


async def setup_agents(cfg: Any, run_dir: Any, rank: int, engine: RolloutEngine, model_path: str) -> AgentRunner:
    """Start the endpoint on `engine` and load the run's agent: `rollout.agent`, or the
    verifiers environment of `data.source: verifiers` (a one-line ValueError names a bad one)."""
    from vllm.tokenizers import get_tokenizer

    from roles.rollout.chat_render import ChatRenderer
    from roles.rollout.openai_server import Limits, endpoint_key

    r = cfg.rollout
    tokenizer = get_tokenizer(model_path)
    model_config = await engine.engine.call(lambda llm: llm.vllm_config.model_config)
    renderer = ChatRenderer(model_config, tokenizer, r.openai.tool_parser)
    o = r.openai
    limits = Limits(o.max_request_bytes, header_timeout_s=o.header_timeout_s, body_timeout_s=o.body_timeout_s)
    server = EndpointServer(
        renderer,
        endpoint_key(run_dir),
        model=o.model_name or "tandem",
        max_model_len=r.engine.max_model_len,
        limits=limits,
    )
    await server.start(cfg.transport.bind_host, r.openai.port + rank if r.openai.port else 0)
    if cfg.data.source == "verifiers":
        from roles.rollout.verifiers_env import VerifiersAgent

        agent: AgentFn = await VerifiersAgent.start(cfg.data.verifiers)
    else:
        agent = load_agent(r.agent)
    return AgentRunner(r, server, agent, tokenizer)


def load_agent(spec: str) -> AgentFn:
    """`module:function`, a sync function wrapped to run in a thread."""
    from runtime.user_functions import load_function

    fn = load_function(spec, what="rollout.agent")
    return fn if inspect.iscoroutinefunction(fn) else sync_agent(fn)
