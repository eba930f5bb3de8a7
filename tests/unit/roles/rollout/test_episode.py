"""The multi-turn loop (roles/rollout/episode.py) against a scripted environment: token
ids, loss masks, logprobs and per-token versions across turns, and every way it ends."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from roles.generation.engine import Sample
from roles.rollout.environment import EnvPrompt, Step, Turn
from roles.rollout.episode import run_episode
from runtime.tiny.model import build_tokenizer
from transport.wire import FinishReason

PROMPT = EnvPrompt(prompt_ids=[1, 2, 3], text="abc", answer="x")


class ScriptedSampler:
    """Plays back one turn per call; records the context each turn was sampled from."""

    def __init__(self, turns: list[tuple[list[int], list[float], list[int]]], finish: FinishReason = FinishReason.STOP):
        self.turns = turns
        self.finish = finish
        self.contexts: list[list[int]] = []
        self.max_tokens: list[int] = []

    async def __call__(self, context: list[int], max_tokens: int, turn: int) -> Sample:
        self.contexts.append(list(context))
        self.max_tokens.append(max_tokens)
        ids, logprobs, versions = self.turns[turn]
        error = "request timed out after 1s" if self.finish == FinishReason.ERROR else ""
        n = max_tokens
        return Sample(ids[:n], logprobs[:n], versions[:n], self.finish, len(context), 0.01, error)


class ScriptedEnv:
    """Observation ids per step, a reward on the last, done after `done_after` steps."""

    def __init__(self, observations: list[Any], reset: Any = None, done_after: int = 99, rewards: Any = None):
        self.observations = observations
        self.reset_obs = reset
        self.done_after = done_after
        self.rewards = rewards or {}
        self.turns: list[Turn] = []
        self.prompts: list[EnvPrompt] = []
        self.closed = 0

    async def reset(self, prompt: EnvPrompt) -> Any:
        self.prompts.append(prompt)
        return self.reset_obs

    async def step(self, turn: Turn) -> Step:
        self.turns.append(turn)
        done = len(self.turns) >= self.done_after
        return Step(self.observations[turn.index], self.rewards.get(turn.index), done)

    def close(self) -> None:
        self.closed += 1


TURNS = [
    ([10, 11], [-0.1, -0.2], [3, 3]),
    ([12, 13, 14], [-0.3, -0.4, -0.5], [3, 4, 4]),  # a weight update lands mid-turn
    ([15], [-0.6], [5]),
]


async def episode(env: Any, sampler: ScriptedSampler, **kw: Any) -> Any:
    args: dict[str, Any] = dict(max_turns=3, max_tokens=8, max_total_tokens=64, call_timeout_s=1.0, tokenizer=None)
    args.update(kw)
    return await run_episode(env, PROMPT, sampler, **args)


def test_three_turns_keep_sampled_tokens_and_mask_observations() -> None:
    env = ScriptedEnv([[90, 91], [92], [93]], reset=[80], rewards={0: 0.25, 2: 1.0})
    sampler = ScriptedSampler(TURNS)
    traj = asyncio.run(episode(env, sampler))
    assert traj.token_ids == [80, 10, 11, 90, 91, 12, 13, 14, 92, 15]
    assert traj.loss_mask == [0, 1, 1, 0, 0, 1, 1, 1, 0, 1]
    assert traj.logprobs == [0.0, -0.1, -0.2, 0.0, 0.0, -0.3, -0.4, -0.5, 0.0, -0.6]
    assert traj.versions == [3, 3, 3, 3, 3, 3, 4, 4, 4, 5]
    assert (traj.num_turns, traj.reward, traj.finish_reason, traj.error) == (3, 1.25, FinishReason.STOP, "")
    # Token in, token out: every turn is sampled from the prompt plus the trajectory as it stood.
    assert sampler.contexts == [
        [1, 2, 3, 80],
        [1, 2, 3, 80, 10, 11, 90, 91],
        [1, 2, 3, 80, 10, 11, 90, 91, 12, 13, 14, 92],
    ]
    assert [t.token_ids for t in env.turns] == [[10, 11], [12, 13, 14], [15]]
    assert env.prompts == [PROMPT] and env.closed == 1


def test_done_ends_the_sample_without_its_observation() -> None:
    env = ScriptedEnv([[90], [91], [92]], done_after=2, rewards={1: 1.0})
    traj = asyncio.run(episode(env, ScriptedSampler(TURNS)))
    assert traj.token_ids == [10, 11, 90, 12, 13, 14]
    assert traj.loss_mask == [1, 1, 0, 1, 1, 1]
    assert (traj.num_turns, traj.reward) == (2, 1.0)


def test_max_turns_bounds_the_sample() -> None:
    traj = asyncio.run(episode(ScriptedEnv([[90], [91], [92]]), ScriptedSampler(TURNS), max_turns=1))
    assert (traj.token_ids, traj.num_turns, traj.reward) == ([10, 11], 1, None)


def test_the_total_budget_caps_turns_and_refuses_an_observation_that_does_not_fit() -> None:
    sampler = ScriptedSampler(TURNS)
    traj = asyncio.run(episode(ScriptedEnv([[90], [91, 92, 93], [94]]), sampler, max_total_tokens=5))
    # Turn 0 (2) + obs (1) leave 2 tokens: turn 1 is cut to 2, then its 3-token observation cannot fit.
    assert sampler.max_tokens == [5, 2]
    assert traj.token_ids == [10, 11, 90, 12, 13]
    assert traj.finish_reason == FinishReason.LENGTH


def test_text_observations_are_encoded_and_turns_decoded() -> None:
    tok = build_tokenizer()
    hi = tok.encode("hi", add_special_tokens=False)
    env = ScriptedEnv(["ok", "no", None], done_after=3)
    traj = asyncio.run(episode(env, ScriptedSampler([(hi, [-1.0, -1.0], [0, 0])] * 3), tokenizer=tok, max_turns=3))
    ok = tok.encode("ok", add_special_tokens=False)
    no = tok.encode("no", add_special_tokens=False)
    assert traj.token_ids == hi + ok + hi + no + hi
    assert [t.text for t in env.turns] == ["hi", "hi", "hi"]


class Faulty:
    def __init__(self, fault: str) -> None:
        self.fault = fault

    async def step(self, turn: Turn) -> Any:
        if self.fault == "raise":
            raise KeyError("boom")
        if self.fault == "hang":
            await asyncio.sleep(3600)
        if self.fault == "garbage":
            return {"observation": [1]}
        return Step(observation=[1.5])


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ("raise", "environment step raised KeyError: 'boom'"),
        ("hang", "environment step did not return in 0.05s (rollout.env_timeout_s)"),
        ("garbage", "environment step returned dict, not a Step"),
        ("bad_obs", "environment step returned an observation that is neither text nor token ids"),
    ],
)
def test_environment_faults_end_the_sample_as_an_error(fault: str, error: str) -> None:
    traj = asyncio.run(episode(Faulty(fault), ScriptedSampler(TURNS), call_timeout_s=0.05))
    assert (traj.finish_reason, traj.error) == (FinishReason.ERROR, error)
    assert traj.token_ids == [10, 11] and traj.loss_mask == [1, 1]  # what was sampled before the fault


def test_a_failed_turn_ends_the_sample_with_its_error() -> None:
    sampler = ScriptedSampler(TURNS, finish=FinishReason.ERROR)
    traj = asyncio.run(episode(ScriptedEnv([[90]] * 3, reset=[80]), sampler, fallback_version=7))
    assert (traj.finish_reason, traj.error, traj.num_turns) == (FinishReason.ERROR, "request timed out after 1s", 1)
    assert traj.versions == [3, 3, 3] and traj.loss_mask == [0, 1, 1]


def test_reset_tokens_take_the_fallback_version_when_nothing_was_sampled() -> None:
    sampler = ScriptedSampler([([], [], [])], finish=FinishReason.ERROR)
    traj = asyncio.run(episode(ScriptedEnv([[90]], reset=[80, 81]), sampler, fallback_version=7))
    assert (traj.token_ids, traj.versions, traj.loss_mask) == ([80, 81], [7, 7], [0, 0])


def test_the_synthetic_task_gives_feedback_then_rewards_the_last_turn() -> None:
    from roles.rollout.synthetic_env import factory

    tok = build_tokenizer()
    letters = [ord(c) for c in "abcd"]
    turns = [(letters[:2] + [ord("z")] * 2, [-1.0] * 4, [0] * 4), ([*letters[:3], ord("z")], [-1.0] * 4, [1] * 4)]
    prompt = EnvPrompt(prompt_ids=letters, text="abcd", answer="abcd")
    traj = asyncio.run(
        run_episode(factory(), prompt, ScriptedSampler(turns), max_turns=4, max_tokens=4, max_total_tokens=64,
                    call_timeout_s=1.0, tokenizer=tok)
    )  # fmt: skip
    feedback = tok.encode("\nscore 2/4, copy: abcd\n", add_special_tokens=False)
    assert traj.token_ids == turns[0][0] + feedback + turns[1][0]
    assert traj.loss_mask == [1] * 4 + [0] * len(feedback) + [1] * 4
    assert (traj.num_turns, traj.reward, traj.versions[-1]) == (2, 0.75, 1)


class Hostile:
    """An environment that misbehaves in one of the ways a fault campaign found."""

    def __init__(self, fault: str) -> None:
        self.fault = fault

    def step(self, turn: Turn) -> Any:  # sync on purpose: a blocking `def` must not block the loop
        import time

        if self.fault == "blocks":
            time.sleep(30)
        if self.fault == "blocks_async":
            return self._blocks_async()
        return {
            "out_of_vocab": Step(observation=[5, 259]),
            "huge_text": Step(observation="x" * (50 * 2**20)),
            "millions_of_ids": Step(observation=range(5_000_000)),
            "string_reward": Step(observation=[1], reward="high"),  # type: ignore[arg-type]
            "nan_reward": Step(observation=[1], reward=float("nan")),
        }[self.fault]

    async def _blocks_async(self) -> Step:
        import time

        time.sleep(30)  # an `async def` that blocks its loop synchronously
        return Step()


@pytest.mark.parametrize(
    ("fault", "finish", "error"),
    [
        ("out_of_vocab", FinishReason.ERROR,
         "environment step returned token id 259, outside the model's vocabulary of 259"),
        ("huge_text", FinishReason.ERROR,
         "environment step returned 52428800 characters of text, over rollout.max_observation_bytes=1048576"),
        ("millions_of_ids", FinishReason.LENGTH, ""),
        ("string_reward", FinishReason.ERROR, "environment step returned reward 'high' (str), not a finite number"),
        ("nan_reward", FinishReason.ERROR, "environment step returned reward nan (float), not a finite number"),
        ("blocks", FinishReason.ERROR, "environment step did not return in 0.3s (rollout.env_timeout_s)"),
        ("blocks_async", FinishReason.ERROR, "environment step did not return in 0.3s (rollout.env_timeout_s)"),
    ],
)  # fmt: skip
def test_a_hostile_environment_costs_its_sample_only(fault: str, finish: FinishReason, error: str) -> None:
    """each fault ends the sample with a one-line reason, the
    event loop keeps running throughout (a ticker counts while the environment blocks), and
    no id outside the vocabulary, no 50 MB text and no five million ids reach the sampler."""
    import time

    tok = build_tokenizer()

    async def run() -> tuple[Any, int, float]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick = asyncio.create_task(ticker())
        sampler = ScriptedSampler(TURNS)
        started = time.monotonic()
        bounds: dict[str, Any] = dict(call_timeout_s=0.3, vocab_size=259, max_observation_bytes=2**20)
        traj = await episode(Hostile(fault), sampler, tokenizer=tok, **bounds)
        tick.cancel()
        assert len(sampler.contexts) == 1  # nothing after the bad step reached the sampler
        return traj, ticks, time.monotonic() - started

    traj, ticks, took = asyncio.run(run())
    assert (traj.finish_reason, traj.error) == (finish, error)
    assert traj.token_ids == [10, 11]
    assert took < 5, took  # the 30 s block is abandoned at the 0.3 s bound
    if fault.startswith("blocks"):
        assert ticks >= 5, ticks  # the loop ran while the environment blocked (~30 ticks unloaded)


def test_an_environment_that_blocks_is_still_closed_at_once() -> None:
    """The thread of an abandoned call is still in it: `close` runs on another, so the
    sample ends at one timeout, not two."""
    import time

    class BlocksThenCloses(Hostile):
        closed = 0

        def close(self) -> None:
            BlocksThenCloses.closed += 1

    started = time.monotonic()
    traj = asyncio.run(episode(BlocksThenCloses("blocks"), ScriptedSampler(TURNS), call_timeout_s=1.0))
    took = time.monotonic() - started
    assert traj.error == "environment step did not return in 1s (rollout.env_timeout_s)"
    # one 1 s bound, not two (2 s and more); 0.9 s of slack for a loaded machine
    assert BlocksThenCloses.closed == 1 and took < 1.9, took
