"""The multi-turn loop: one sample's turns against its environment, token in, token out.

`run_episode` alternates sampler and environment and returns the `Trajectory` after the
prompt. What a caller may rely on:
* Assistant tokens are kept exactly as sampled, with their behaviour logprobs and
  policy versions, loss mask 1; earlier turns are never re-tokenised. Each turn is
  sampled from `prompt_ids + trajectory so far`.
* Observation tokens (from `reset`, then from each `step` that does not end the sample)
  are appended with loss mask 0, logprob 0 and the version of the nearest sampled token
  (the one before, or for `reset`'s the first one), so `min(versions)` is the oldest
  sampled token's.
* The sample ends when the environment says `done`, after `max_turns` turns, when the
  token budget is spent (an observation that does not fit is not appended; finish
  LENGTH), when a turn is aborted or fails (the sampler's error), or when the
  environment raises, returns a bad value or overruns `call_timeout_s` (finish ERROR,
  one-line `error`). The observation of the step that ends the sample is not appended.
* The environment's `close` (if any) is called once, whatever happened.

`turn_sampling` gives each model call of an episode (multi-turn environment or agent) its
sampling: the Generate's, `max_tokens` cut to the budget left, and for a seeded Generate
(`rollout.seeded_sampling`) a seed of the call's own: call 0 keeps the group's, later
calls get unrelated ones, the same in every run of the seed.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from roles.generation.engine import Sample
from roles.rollout.environment import EnvPrompt, Observation, Step, Tokenizer, Turn
from runtime.errors import TandemError, one_line
from runtime.seeds import derived_seed
from transport.wire import FinishReason, SamplingSpec

Sampler = Callable[[list[int], int, int], Awaitable[Sample]]  # (context ids, max_tokens, turn) -> Sample
_TURN_END = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


class EnvFailed(TandemError, RuntimeError):
    """The environment raised, returned a bad value or overran its bound (one line)."""


@dataclass
class Trajectory:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.STOP
    error: str = ""
    reward: float | None = None
    num_turns: int = 0
    routed: list[Any] = field(default_factory=list)  # MoE routing, per turn: the rows that turn added
    _pending: list[int] = field(default_factory=list)  # positions waiting for a version

    def __len__(self) -> int:
        return len(self.token_ids)

    def sampled(self, s: Sample) -> None:
        """Append an assistant turn as sampled (a failed turn's logprobs and versions are
        cut or padded to its tokens, so later positions stay aligned)."""
        n = len(s.token_ids)
        self.token_ids += s.token_ids
        self.logprobs += (list(s.logprobs) + [0.0] * n)[:n]
        fill = s.versions[-1] if s.versions else (self.versions[-1] if self.versions else 0)
        self.versions += (list(s.versions) + [fill] * n)[:n]
        self.loss_mask += [1] * len(s.token_ids)
        self._add_routing(s.routed_experts)
        if s.versions and self._pending:
            for i in self._pending:  # reset's observation: the first sampled token's version
                self.versions[i] = s.versions[0]
            self._pending.clear()

    def observed(self, ids: list[int]) -> None:
        """Append environment tokens (loss mask 0, logprob 0, the previous sampled version)."""
        if not self.versions:
            self._pending += range(len(self.token_ids), len(self.token_ids) + len(ids))
        last = self.versions[-1] if self.versions else 0
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [last] * len(ids)
        self.loss_mask += [0] * len(ids)

    def _add_routing(self, routed: Any) -> None:
        """A turn's routing covers its whole context (prompt, earlier turns, observations) and its
        own tokens: keep only the rows past what earlier turns covered, which this turn computed
        (the observations first seen in its prefill included). A turn without a report ends the
        episode's routing there: later rows are routed by the trainer."""
        covered = sum(len(r) for r in self.routed)
        if routed is None or len(routed) <= covered or (self.num_turns and not self.routed):
            return
        self.routed.append(routed[covered:])

    @property
    def routed_experts(self) -> Any:
        """[N, layers, top_k] for the episode's first N rows (prompt first), or None."""
        if not self.routed:
            return None
        import numpy as np

        return np.concatenate(self.routed, axis=0)

    def rewarded(self, reward: float | None) -> None:
        if reward is not None:
            self.reward = (self.reward or 0.0) + float(reward)

    def settle(self, fallback_version: int) -> Trajectory:
        """Versions of environment tokens no sampled token followed (a sample that failed
        on its first turn) become `fallback_version`."""
        for i in self._pending:
            self.versions[i] = fallback_version
        self._pending.clear()
        return self


async def run_episode(
    env: Any,
    prompt: EnvPrompt,
    sample: Sampler,
    *,
    max_turns: int,
    max_tokens: int,
    max_total_tokens: int,
    call_timeout_s: float,
    tokenizer: Tokenizer | None,
    fallback_version: int = 0,
) -> Trajectory:
    """Run one sample against `env` (see the module docs); never raises for the
    environment's faults, which end the trajectory with finish ERROR."""
    traj = Trajectory()
    try:
        await _turns(env, prompt, sample, traj, max_turns, max_tokens, max_total_tokens, call_timeout_s, tokenizer)
    except EnvFailed as exc:
        traj.finish_reason, traj.error = FinishReason.ERROR, str(exc)
    finally:
        await _close(env, call_timeout_s)
    return traj.settle(fallback_version)


async def _turns(
    env: Any,
    prompt: EnvPrompt,
    sample: Sampler,
    traj: Trajectory,
    max_turns: int,
    max_tokens: int,
    budget: int,
    timeout_s: float,
    tokenizer: Tokenizer | None,
) -> None:
    if callable(getattr(env, "reset", None)):
        ids = _tokens(await _call(env.reset(prompt), timeout_s, "reset"), tokenizer, "reset")
        if len(ids) >= budget:
            raise EnvFailed(f"environment reset's observation ({len(ids)} tokens) leaves no room in the budget")
        traj.observed(ids)
    for index in range(max_turns):
        room = budget - len(traj)
        if room <= 0:
            traj.finish_reason = FinishReason.LENGTH
            return
        s = await sample(list(prompt.prompt_ids) + traj.token_ids, min(max_tokens, room), index)
        traj.sampled(s)
        traj.num_turns += 1
        traj.finish_reason = s.finish_reason
        if s.error or s.finish_reason not in _TURN_END:
            traj.error = s.error
            return
        text = tokenizer.decode(s.token_ids, skip_special_tokens=False) if tokenizer is not None else ""
        turn = Turn(index=index, token_ids=list(s.token_ids), text=text, finish_reason=_TURN_END[s.finish_reason])
        step = await _call(env.step(turn), timeout_s, "step")
        if not isinstance(step, Step):
            raise EnvFailed(f"environment step returned {type(step).__name__}, not a Step")
        traj.rewarded(step.reward)
        if step.done or index == max_turns - 1:
            return
        ids = _tokens(step.observation, tokenizer, "step")
        if len(traj) + len(ids) >= budget:
            traj.finish_reason = FinishReason.LENGTH  # no room for the observation and a turn after it
            return
        traj.observed(ids)


async def _call(result: Any, timeout_s: float, what: str) -> Any:
    """Await an environment call within `timeout_s`; its faults become EnvFailed."""
    try:
        return await asyncio.wait_for(result, timeout_s) if inspect.isawaitable(result) else result
    except TimeoutError:
        raise EnvFailed(f"environment {what} did not return in {timeout_s:g}s (rollout.env_timeout_s)") from None
    except (asyncio.CancelledError, EnvFailed):
        raise
    except Exception as exc:
        raise EnvFailed(f"environment {what} raised {one_line(exc)}") from None


def _tokens(obs: Observation, tokenizer: Tokenizer | None, what: str) -> list[int]:
    """An observation as token ids: text is encoded with no special tokens added."""
    if obs is None:
        return []
    if isinstance(obs, str):
        if tokenizer is None:
            raise EnvFailed(f"environment {what} returned text but the rollout has no tokenizer")
        return list(tokenizer.encode(obs, add_special_tokens=False))
    ids = list(obs)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise EnvFailed(f"environment {what} returned an observation that is neither text nor token ids")
    return ids


async def _close(env: Any, timeout_s: float) -> None:
    close = getattr(env, "close", None)
    if callable(close):
        try:
            await _call(close(), timeout_s, "close")
        except EnvFailed:
            pass  # the sample is already finished; a failing close must not cost it


def turn_sampling(spec: SamplingSpec, max_tokens: int, turn: int) -> SamplingSpec:
    """`spec` for model call `turn` (0, 1, ...) of an episode: `max_tokens` as given and,
    when `spec` is seeded, the call's own seed (48 bits; the engine adds the sample index)."""
    seed = spec.seed
    if seed is not None and turn > 0:
        seed = derived_seed("turn", seed, turn)
    return msgspec.structs.replace(spec, max_tokens=max_tokens, seed=seed)
