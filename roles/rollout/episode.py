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
* A bad value is any of: a step that is not a `Step`; a reward that is not a finite
  number; an observation that is neither text nor token ids, holds an id outside
  `[0, vocab_size)` (checked before any id reaches the engine), or is text of more than
  `max_observation_bytes` (refused before it is tokenized). Token ids past the budget
  left are never read one by one: they do not fit (finish LENGTH).
* Every environment call (`reset`, `step`, `close`, and the tokenizing of its text) runs
  on a thread of its own (roles/rollout/env_thread.py), so an environment that blocks,
  `def` or `async def`, costs its sample only, at `call_timeout_s`; the caller's event
  loop never waits on it.
* The environment's `close` (if any) is called once, whatever happened.

`turn_sampling` gives each model call of an episode (multi-turn environment or agent) its
sampling: the Generate's, `max_tokens` cut to the budget left, and for a seeded Generate
(`rollout.seeded_sampling`) a seed of the call's own: call 0 keeps the group's, later
calls get unrelated ones, the same in every run of the seed.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from roles.generation.engine import Sample
from roles.rollout.env_thread import EnvThread
from roles.rollout.environment import EnvPrompt, Observation, Step, Tokenizer, Turn
from runtime.errors import TandemError, one_line
from runtime.seeds import derived_seed
from transport.wire import FinishReason, SamplingSpec

Sampler = Callable[[list[int], int, int], Awaitable[Sample]]  # (context ids, max_tokens, turn) -> Sample
_TURN_END = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
_TOKENIZER_LOCK = threading.Lock()  # a fast tokenizer is not safe to call from two threads at once


@dataclass(frozen=True)
class EnvBounds:
    """What an environment's answers are checked against (0: no bound)."""

    call_timeout_s: float
    vocab_size: int = 0
    max_observation_bytes: int = 0


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
    vocab_size: int = 0,
    max_observation_bytes: int = 0,
) -> Trajectory:
    """Run one sample against `env` (see the module docs); never raises for the
    environment's faults, which end the trajectory with finish ERROR."""
    traj = Trajectory()
    bounds = EnvBounds(call_timeout_s, vocab_size, max_observation_bytes)
    worker = EnvThread()
    try:
        await _turns(env, prompt, sample, traj, max_turns, max_tokens, max_total_tokens, bounds, tokenizer, worker)
    except EnvFailed as exc:
        traj.finish_reason, traj.error = FinishReason.ERROR, str(exc)
    finally:
        await _close(env, worker, call_timeout_s)
        worker.close()
    return traj.settle(fallback_version)


async def _turns(
    env: Any,
    prompt: EnvPrompt,
    sample: Sampler,
    traj: Trajectory,
    max_turns: int,
    max_tokens: int,
    budget: int,
    bounds: EnvBounds,
    tokenizer: Tokenizer | None,
    worker: EnvThread,
) -> None:
    if callable(getattr(env, "reset", None)):
        reset = await _call(worker, lambda: env.reset(prompt), bounds.call_timeout_s, "reset")
        ids = await _observation(worker, reset, tokenizer, bounds, budget, "reset")
        if ids is None or len(ids) >= budget:
            size = "more than the budget" if ids is None else f"{len(ids)} tokens"
            raise EnvFailed(f"environment reset's observation ({size}) leaves no room in the budget")
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
        step = await _call(worker, functools.partial(env.step, turn), bounds.call_timeout_s, "step")
        if not isinstance(step, Step):
            raise EnvFailed(f"environment step returned {type(step).__name__}, not a Step")
        traj.rewarded(_reward(step.reward))
        if step.done or index == max_turns - 1:
            return
        ids = await _observation(worker, step.observation, tokenizer, bounds, budget - len(traj), "step")
        if ids is None or len(traj) + len(ids) >= budget:
            traj.finish_reason = FinishReason.LENGTH  # no room for the observation and a turn after it
            return
        traj.observed(ids)


async def _call(worker: EnvThread, fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """One environment call on `worker`'s thread within `timeout_s`; its faults become EnvFailed."""
    try:
        return await worker.call(fn, timeout_s)
    except TimeoutError:
        raise EnvFailed(f"environment {what} did not return in {timeout_s:g}s (rollout.env_timeout_s)") from None
    except (asyncio.CancelledError, EnvFailed):
        raise
    except Exception as exc:
        raise EnvFailed(f"environment {what} raised {one_line(exc)}") from None


def _reward(reward: Any) -> float | None:
    """A step's reward: None or a finite number, else EnvFailed."""
    if reward is None:
        return None
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        shown = " ".join(repr(reward).split())[:60]
        raise EnvFailed(f"environment step returned reward {shown} ({type(reward).__name__}), not a finite number")
    return float(reward)


async def _observation(
    worker: EnvThread, obs: Observation, tokenizer: Tokenizer | None, bounds: EnvBounds, room: int, what: str
) -> list[int] | None:
    """An observation as token ids (text is encoded on `worker`'s thread, no special tokens
    added); None when it holds more than `room` ids. EnvFailed for a bad one."""
    if isinstance(obs, str):
        cap = bounds.max_observation_bytes
        if cap and (len(obs) > cap or len(obs.encode("utf-8", "surrogatepass")) > cap):
            raise EnvFailed(
                f"environment {what} returned {len(obs)} characters of text, over rollout.max_observation_bytes={cap}"
            )
        if tokenizer is None:
            raise EnvFailed(f"environment {what} returned text but the rollout has no tokenizer")
        encode = functools.partial(_encode, tokenizer, obs)
        obs = await _call(worker, encode, bounds.call_timeout_s, f"{what}'s text encoding")
    return _ids(obs, bounds.vocab_size, room, what)


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    with _TOKENIZER_LOCK:
        return list(tokenizer.encode(text, add_special_tokens=False))


def _ids(obs: Any, vocab_size: int, room: int, what: str) -> list[int] | None:
    """Token ids checked one by one, at most `room` + 1 of them read (None: over `room`)."""
    if obs is None:
        return []
    try:
        ids = list(itertools.islice(iter(obs), max(room, 0) + 1))
    except TypeError:
        raise EnvFailed(f"environment {what} returned an observation that is neither text nor token ids") from None
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise EnvFailed(f"environment {what} returned an observation that is neither text nor token ids")
    if vocab_size and ids and max(ids) >= vocab_size:
        raise EnvFailed(
            f"environment {what} returned token id {max(ids)}, outside the model's vocabulary of {vocab_size}"
        )
    return None if len(ids) > room else ids


async def _close(env: Any, worker: EnvThread, timeout_s: float) -> None:
    """`env.close()`, on a fresh thread when `worker` is still held by an abandoned call."""
    close = getattr(env, "close", None)
    if not callable(close):
        return
    fresh = EnvThread() if worker.blocked else None
    try:
        await _call(fresh or worker, close, timeout_s, "close")
    except EnvFailed:
        pass  # the sample is already finished; a failing close must not cost it
    finally:
        if fresh is not None:
            fresh.close()


def turn_sampling(spec: SamplingSpec, max_tokens: int, turn: int) -> SamplingSpec:
    """`spec` for model call `turn` (0, 1, ...) of an episode: `max_tokens` as given and,
    when `spec` is seeded, the call's own seed (48 bits; the engine adds the sample index)."""
    seed = spec.seed
    if seed is not None and turn > 0:
        seed = derived_seed("turn", seed, turn)
    return msgspec.structs.replace(spec, max_tokens=max_tokens, seed=seed)
