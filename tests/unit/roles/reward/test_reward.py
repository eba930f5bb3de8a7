"""Reward runner (sums, timeouts, errors, declared keyword arguments) and the built-in rewards.

The reward functions under test live in this module and are named by spec
`tests.unit.roles.reward.test_reward:NAME`, exactly as a user's would be.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import Any

import numpy as np
import pytest

from roles.reward.builtin import copy_task, extract_answer, gsm8k_exact_match
from roles.reward.runner import ARGUMENTS, RewardRunner
from runtime.user_functions import load_function

HERE = __name__
TIMEOUT_S = 0.2
_NEVER = threading.Event()  # never set: a sync function waiting on it hangs for good


def const_one(**_: Any) -> float:
    return 1.0


async def async_half(answer: str) -> float:
    await asyncio.sleep(0)
    return 0.5 if answer == "yes" else 0.0


def sleeps_forever(prompt: str) -> float:
    while not _NEVER.is_set():
        time.sleep(3600)
    return 1.0


async def awaits_forever(prompt: str) -> float:
    await asyncio.sleep(1e9)
    return 1.0


def raises(completion: str) -> float:
    raise RuntimeError(f"cannot score {completion!r}")


def not_a_number() -> str:
    return "high"


def takes_two(completion: str, answer: str) -> float:
    """Raises unless given exactly these two (calls run in another process: the result is the evidence)."""
    assert (completion, answer) == ("c", "yes")
    return 0.25


def torch_is_loaded() -> float:
    import sys

    return float("torch" in sys.modules)


def takes_all(prompt: str, **kwargs: Any) -> float:
    assert prompt == "p" and set(kwargs) == set(ARGUMENTS) - {"prompt"}
    assert kwargs["metadata"] == {"k": 1} and kwargs["completion_ids"] == [3]
    return 0.5


def holds_the_gil(completion: str) -> float:
    """Catastrophic backtracking: the regex engine holds the GIL for minutes."""
    import re

    return float(bool(re.match(r"(a+)+$", "a" * 40 + "b")))


async def blocks_its_loop(completion: str) -> float:
    time.sleep(3600)  # a sync sleep inside an async function
    return 1.0


def nan_or_inf(completion: str) -> float:
    return {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}.get(completion, 0.25)


def huge(completion: str) -> float:
    return {"huge": 1e308, "-huge": -2e6}.get(completion, 0.5)


def numpy_scalar(completion: str) -> Any:  # numpy is imported with this module: not in the call's 0.2 s
    return {"f32": np.float32(0.5), "i64": np.int64(1), "0d": np.array(0.75), "bool": np.bool_(True)}[completion]


def wrong_signature(text: str) -> float:
    return 0.0


NOT_CALLABLE = 3


def _item(**changes: Any) -> dict[str, Any]:
    item = {
        "prompt": "p",
        "completion": "c",
        "answer": "yes",
        "metadata": {"k": 1},
        "prompt_ids": [1, 2],
        "completion_ids": [3],
    }
    return {**item, **changes}


def _runner(*names: str, concurrency: int = 16, max_magnitude: float = math.inf) -> RewardRunner:
    specs = [f"{HERE}:{n}" for n in names]
    return RewardRunner(specs, timeout_s=TIMEOUT_S, concurrency=concurrency, max_magnitude=max_magnitude)


async def _warm(runner: RewardRunner, workers: int) -> None:
    """Start `workers` worker processes (a start is no part of any call's timeout)."""
    await asyncio.gather(*(runner.pool.call(f"{HERE}:const_one", {}, 60.0) for _ in range(workers)))


async def test_the_reward_is_the_sum_of_every_function() -> None:
    runner = _runner("const_one", "async_half")
    assert await runner.score(_item()) == (1.5, "", "")
    assert await runner.score(_item(answer="no")) == (1.0, "", "")
    assert not runner.failures


@pytest.mark.parametrize("name", ["sleeps_forever", "awaits_forever"])
async def test_a_hanging_function_scores_zero_without_blocking_others(name: str) -> None:
    runner = _runner(name, "const_one")
    good = _runner("const_one", "async_half")
    await _warm(runner, 2)  # the hanging call's worker is killed; const_one then runs in the other
    await _warm(good, 5)
    start = time.monotonic()
    hung, *rest = await asyncio.gather(runner.score(_item()), *(good.score(_item()) for _ in range(5)))
    assert hung[0] == 1.0  # only the hanging function scored 0; const_one still counted
    assert f"{HERE}:{name} timed out after 0.2s" in hung[1] and hung[2] == "timeout"
    assert rest == [(1.5, "", "")] * 5
    assert time.monotonic() - start < TIMEOUT_S + 1.0
    assert runner.failures == {f"{HERE}:{name}": 1} and runner.pool.killed == 1


async def test_good_calls_finish_before_the_hanging_one_times_out() -> None:
    runner = _runner("sleeps_forever", "const_one")
    good = _runner("const_one")
    await _warm(runner, 1)
    await _warm(good, 5)
    hanging = asyncio.ensure_future(runner.score(_item()))
    start = time.monotonic()
    results = await asyncio.gather(*(good.score(_item()) for _ in range(5)))
    assert results == [(1.0, "", "")] * 5
    assert time.monotonic() - start < TIMEOUT_S
    assert not hanging.done()
    assert (await hanging)[0] == 1.0  # const_one's part; the hanging one scored 0


async def test_a_raising_function_scores_zero_with_the_exception_text() -> None:
    runner = _runner("raises", "const_one")
    value, error, reason = await runner.score(_item(completion="xyz"))
    assert value == 1.0 and reason == "raised"
    assert error == f"{HERE}:raises RuntimeError: cannot score 'xyz'"
    value, error, reason = await _runner("not_a_number").score(_item())
    assert value == 0.0 and "returned str 'high', not a number" in error and reason == "not_a_number"
    assert sum(runner.failures.values()) == 1


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
async def test_a_non_finite_reward_is_a_failure_that_scores_zero(value: str) -> None:
    """NaN or inf from a reward function used to become the sample's reward, and
    reward_mean, loss and grad_norm NaN from then on."""
    runner = _runner("nan_or_inf", "const_one")
    total, error, reason = await runner.score(_item(completion=value))
    assert total == 1.0 and reason == "nonfinite"
    assert error == f"{HERE}:nan_or_inf returned {float(value)}, not a finite number"
    assert await runner.score(_item(completion="ok")) == (1.25, "", "")
    assert runner.reasons == {(f"{HERE}:nan_or_inf", "nonfinite"): 1}
    runner.close()


@pytest.mark.parametrize("completion", ["huge", "-huge"])
async def test_a_reward_beyond_max_magnitude_is_a_failure_under_its_function(completion: str) -> None:
    """1e308 is finite, but a batch of them made the reward mean
    infinite and the loss NaN from step 1, blamed on the loss, never on the function."""
    runner = _runner("huge", "const_one", max_magnitude=1e6)
    total, error, reason = await runner.score(_item(completion=completion))
    assert total == 1.0 and reason == "out_of_range"
    assert error.startswith(f"{HERE}:huge returned ") and error.endswith("beyond reward.max_magnitude=1e+06")
    assert await runner.score(_item(completion="ok")) == (1.5, "", "")
    assert runner.reasons == {(f"{HERE}:huge", "out_of_range"): 1}
    runner.close()


@pytest.mark.parametrize(("completion", "expected"), [("f32", 0.5), ("i64", 1.0), ("0d", 0.75)])
async def test_numpy_numbers_are_numbers(completion: str, expected: float) -> None:
    runner = _runner("numpy_scalar")
    assert await runner.score(_item(completion=completion)) == (expected, "", "")
    total, error, reason = await runner.score(_item(completion="bool"))
    assert total == 0.0 and reason == "not_a_number" and "returned bool True" in error
    runner.close()


async def test_functions_get_only_the_arguments_they_declare() -> None:
    assert await _runner("takes_two", "takes_all").score(_item()) == (0.75, "", "")


async def test_the_pool_starts_every_worker_up_front_and_light() -> None:
    """A worker imports only the reward functions (not the role's entry point and torch,
    as a `multiprocessing` spawn would): 16 start in seconds on a 2-core machine, before
    the role says it is ready, so no reward request waits for a start."""
    import psutil

    runner = _runner("torch_is_loaded", concurrency=16)
    started = time.perf_counter()
    await runner.start()
    took = time.perf_counter() - started
    alive = {c.pid for c in psutil.Process().children()}
    assert len(runner.pool.pids()) == 16 and set(runner.pool.pids()) <= alive
    assert await runner.score(_item()) == (0.0, "", ""), "a reward worker imported torch"
    # The bound is the behaviour (workers start up front, in seconds, not per request): about
    # 10 s on an idle 2-core box, 37 s seen on a loaded one; 3x slack over that.
    assert took < 120, f"16 workers took {took:.1f}s to start"
    runner.close()


@pytest.mark.parametrize("name", ["holds_the_gil", "blocks_its_loop"])
async def test_a_function_that_starves_its_process_scores_zero_and_the_role_goes_on(name: str) -> None:
    """A function that holds the GIL or blocks its loop used to starve the reward role's event loop until the
    run died as "reward-0 went silent". They run in worker processes now: the role's loop
    keeps turning, and the worker is killed at the timeout."""
    import psutil

    runner = _runner(name, "const_one")
    await _warm(runner, 1)
    (starved,) = runner.pool.pids()  # the worker the starving call will get
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.ensure_future(tick())
    value, error, _ = await runner.score(_item())
    ticker.cancel()
    assert value == 1.0 and f"{HERE}:{name} timed out after 0.2s" in error
    assert ticks >= 10  # the loop ran all along
    assert runner.pool.killed == 1
    await runner.pool.settled()  # the killed worker's replacement
    alive = {c.pid for c in psutil.Process().children() if c.status() != psutil.STATUS_ZOMBIE}
    assert starved not in alive and set(runner.pool.pids()) <= alive  # the starved worker is gone
    runner.close()


def test_a_signature_no_reward_call_can_satisfy_is_refused_at_load() -> None:
    with pytest.raises(ValueError, match=r"wrong_signature': parameter 'text' is not one it can be given"):
        _runner("wrong_signature")


def test_load_function_errors_name_the_failing_part() -> None:
    with pytest.raises(ValueError, match=r"cannot import 'no_such_module_xyz'"):
        load_function("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match=r"'missing' is not a callable in tests\.unit\.roles\.reward\.test_reward"):
        load_function(f"{HERE}:missing")
    with pytest.raises(ValueError, match=r"'NOT_CALLABLE' is not a callable"):
        load_function(f"{HERE}:NOT_CALLABLE")
    assert load_function("roles.reward.builtin:copy_task") is copy_task


def test_copy_task_by_hand() -> None:
    abc = [ord(c) for c in "abc"]
    assert copy_task(completion_ids=abc, answer="abc") == 1.0
    assert copy_task(completion_ids=[*abc, ord("z")], answer="abc") == 0.75
    assert copy_task(completion_ids=[ord("a"), ord("a"), 32, 300, 10], answer="cab") == 0.4
    assert copy_task(completion_ids=[], answer="abc") == 0.0
    assert copy_task(completion_ids=abc, answer=None) == 0.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the total is\n#### 42", "42"),
        ("#### 1,234", "1234"),
        ("the answer is \\boxed{3.50}.", "3.5"),
        ("#### -7", "-7"),
        ("first \\boxed{1} then \\boxed{ 2 }", "2"),
        ("#### 10.0", "10"),
        ("#### 100", "100"),
        ("no number here", None),
        ("#### many", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("completion", "answer", "score"),
    [
        ("#### 42", "42", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("\\boxed{3.50}", "3.5", 1.0),
        ("#### -3", "-3", 1.0),
        ("#### 3", "-3", 0.0),
        ("Janet has 16 - 3 - 4 = 9 eggs. #### 18", "She sells 9 * 2 = <<9*2=18>>18.\n#### 18", 1.0),
        ("#### 17", "She sells 9 * 2 = <<9*2=18>>18.\n#### 18", 0.0),
        ("I think it is 42", "42", 0.0),
        ("#### 42", None, 0.0),
    ],
)
def test_gsm8k_exact_match(completion: str, answer: str | None, score: float) -> None:
    assert gsm8k_exact_match(completion, answer) == score


def test_overlong_penalty_by_hand() -> None:
    from roles.algo.shaping import overlong_penalty

    kw = dict(max_tokens=16, buffer=4, penalty=1.0)
    assert [overlong_penalty(n, **kw) for n in (0, 12, 13, 14, 16, 20)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]


def math_verify_is_loaded() -> float:
    """1.0 when this worker imported math-verify before its first call."""
    import sys

    return 1.0 if "math_verify" in sys.modules else 0.0


async def test_math_verify_is_imported_when_its_workers_start_not_in_the_first_call() -> None:
    """`math_equal` imported math-verify inside the call: sixteen workers (the default
    `reward.concurrency`) importing it at once on a loaded 2-core machine took 11-15 s, past
    the default `reward.timeout_s`, and the run died at step 1. Each worker's very first call
    finds it imported now, and the default pool scores its first sixteen calls in time."""
    pytest.importorskip("math_verify")
    from runtime.config.reward import RewardConfig

    defaults = RewardConfig()
    specs = ["roles.reward.math_verify:math_equal", f"{HERE}:math_verify_is_loaded"]
    runner = RewardRunner(specs, timeout_s=defaults.timeout_s, concurrency=defaults.concurrency)
    await runner.start()
    pool = runner.pool
    assert len(pool.pids()) == defaults.concurrency
    firsts = await asyncio.gather(*(pool.call(specs[1], {}, 60.0) for _ in range(defaults.concurrency)))
    assert firsts == [1.0] * defaults.concurrency, "a worker had not imported math_verify when it started"
    item = _item(completion="so \\boxed{\\frac{1}{2}}", answer="0.5")
    scores = await asyncio.gather(*(runner.score(item) for _ in range(defaults.concurrency)))
    assert scores == [(2.0, "", "")] * defaults.concurrency and pool.killed == 0  # 1 + math_verify_is_loaded
    runner.close()


async def test_a_worker_that_cannot_start_says_so_not_a_call_timeout() -> None:
    """A worker that died while starting was reported as "did not start in 120s", seconds
    after it started: the message says it exited, with its exit code, and is no timeout."""
    from roles.reward.workers import RewardCallError, WorkerPool

    pool = WorkerPool(["tests.helpers.raises_at_import:score"], 1)
    with pytest.raises(RewardCallError) as caught:
        await pool.start()
    assert str(caught.value).startswith("a reward worker exited while starting (exit code 1")
    assert caught.value.reason == "worker_died"
    pool.close()


def module_is_loaded(completion: str) -> float:
    """1.0 when this worker has imported the module named by `completion`."""
    import sys

    return 1.0 if completion in sys.modules else 0.0


async def test_reasoning_gym_is_imported_when_its_worker_starts() -> None:
    """The reasoning-gym scorer imported reasoning-gym (4 s of CPU) inside its first call:
    sixteen workers doing that at once timed out at step 1 as math-verify did."""
    pytest.importorskip("reasoning_gym")
    from roles.reward.workers import WorkerPool

    pool = WorkerPool(["roles.reward.reasoning_gym:score", f"{HERE}:module_is_loaded"], 1)
    await pool.start()
    assert await pool.call(f"{HERE}:module_is_loaded", {"completion": "reasoning_gym"}, 60.0) == 1.0
    pool.close()
