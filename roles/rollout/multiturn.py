"""The rollout's side of `rollout.env`: one environment per sample, its episode run on the
role's engine, the trajectory sent back as one `wire.Completion`.

What a caller may rely on: `EpisodeRunner.complete` never raises for the environment's
faults (a factory that raises, an environment that fails, blocks, or answers with ids
outside the model's vocabulary or text over `rollout.max_observation_bytes`: the
completion carries the error) and raises `EngineDeadError` only when the engine died. Each turn is one engine request
(`<request_id>.t<turn>`) with the Generate's sampling, `max_tokens` cut to the budget
left (`turn_sampling`: a seeded Generate's turns draw afresh); the whole sample is
bounded by `rollout.request_timeout_s`.
"""

from __future__ import annotations

import time
from typing import Any

from roles.generation.engine import RolloutEngine, Sample
from roles.rollout.completion import completion_message
from roles.rollout.environment import EnvContext, EnvPrompt
from roles.rollout.episode import Trajectory, run_episode, turn_sampling
from roles.rollout.tools import ToolRegistry
from runtime.config import RolloutConfig
from runtime.errors import one_line
from runtime.user_functions import env_factory_takes_context, load_env_factory
from transport import wire


class EpisodeRunner:
    def __init__(self, cfg: RolloutConfig, tokenizer: Any) -> None:
        """Load `cfg.env` and `cfg.tools` (a one-line ValueError names a bad one)."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.factory = load_env_factory(cfg.env)
        self.with_context = env_factory_takes_context(self.factory)
        self.tools = ToolRegistry(cfg.tools, cfg.tool_timeout_s)
        self.vocab_size = 0  # the engine's, read at the first episode

    async def _vocab(self, engine: RolloutEngine) -> int:
        """The model's vocabulary size as vLLM holds it: ids from an environment must be below it."""
        if not self.vocab_size:
            self.vocab_size = int(await engine.engine.call(lambda llm: llm.vllm_config.model_config.get_vocab_size()))
        return self.vocab_size

    def budget(self, max_tokens: int) -> int:
        return self.cfg.max_total_tokens or self.cfg.max_turns * max_tokens

    async def complete(self, engine: RolloutEngine, req: wire.Generate, index: int) -> wire.Completion:
        started = time.perf_counter()
        deadline = time.monotonic() + self.cfg.request_timeout_s

        async def sample(context: list[int], max_tokens: int, turn: int) -> Sample:
            spec = turn_sampling(req.sampling, max_tokens, turn)
            left = max(1e-3, deadline - time.monotonic())
            return await engine.generate(f"{req.request_id}.t{turn}", context, spec, index, timeout_s=left)

        try:
            env = self.factory(EnvContext(self.tools, self.tokenizer)) if self.with_context else self.factory()
        except Exception as exc:
            traj = Trajectory(
                finish_reason=wire.FinishReason.ERROR, error=f"rollout.env factory raised {one_line(exc)}"
            )
        else:
            text = self.tokenizer.decode(req.prompt_ids, skip_special_tokens=False) if self.tokenizer else ""
            prompt = EnvPrompt(list(req.prompt_ids), text, req.answer, dict(req.metadata), index)
            traj = await run_episode(
                env,
                prompt,
                sample,
                max_turns=self.cfg.max_turns,
                max_tokens=req.sampling.max_tokens,
                max_total_tokens=self.budget(req.sampling.max_tokens),
                call_timeout_s=self.cfg.env_timeout_s,
                tokenizer=self.tokenizer,
                fallback_version=engine.version,
                vocab_size=await self._vocab(engine),
                max_observation_bytes=self.cfg.max_observation_bytes,
            )
        return completion(req, index, traj, time.perf_counter() - started)


def completion(req: wire.Generate, index: int, t: Trajectory, gen_s: float) -> wire.Completion:
    return completion_message(
        req,
        index,
        token_ids=t.token_ids,
        logprobs=t.logprobs,
        versions=t.versions,
        finish_reason=t.finish_reason,
        prompt_len=len(req.prompt_ids),
        gen_s=gen_s,
        error=t.error,
        loss_mask=t.loss_mask,
        env_reward=t.reward,
        num_turns=t.num_turns,
        routed_experts=t.routed_experts,
    )
