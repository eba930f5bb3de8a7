"""Reward runner (sums, timeouts, errors, declared keyword arguments) and the built-in rewards.

The reward functions under test live in this module and are named by spec
`tests.unit.test_reward:NAME`, exactly as a user's would be.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from roles.reward.builtin import copy_task, extract_answer, gsm8k_exact_match
from roles.reward.runner import ARGUMENTS, RewardRunner, load_function

HERE = __name__
TIMEOUT_S = 0.2
SEEN: dict[str, Any] = {}
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
    SEEN["takes_two"] = {"completion": completion, "answer": answer}
    return 0.0


def takes_all(prompt: str, **kwargs: Any) -> float:
    SEEN["takes_all"] = {"prompt": prompt, **kwargs}
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


def _runner(*names: str, concurrency: int = 16) -> RewardRunner:
    return RewardRunner([f"{HERE}:{n}" for n in names], timeout_s=TIMEOUT_S, concurrency=concurrency)


async def test_the_reward_is_the_sum_of_every_function() -> None:
    runner = _runner("const_one", "async_half")
    assert await runner.score(_item()) == (1.5, "")
    assert await runner.score(_item(answer="no")) == (1.0, "")
    assert runner.failures == 0


@pytest.mark.parametrize("name", ["sleeps_forever", "awaits_forever"])
async def test_a_hanging_function_scores_zero_without_blocking_others(name: str) -> None:
    runner = _runner(name, "const_one")
    good = _runner("const_one", "async_half")
    start = time.monotonic()
    hung, *rest = await asyncio.gather(runner.score(_item()), *(good.score(_item()) for _ in range(5)))
    assert hung[0] == 1.0  # only the hanging function scored 0; const_one still counted
    assert f"{HERE}:{name} timed out after 0.2s" in hung[1]
    assert rest == [(1.5, "")] * 5
    assert time.monotonic() - start < TIMEOUT_S + 1.0
    assert runner.failures == 1
    assert runner.abandoned == (1 if name == "sleeps_forever" else 0)


async def test_good_calls_finish_before_the_hanging_one_times_out() -> None:
    runner = _runner("sleeps_forever")
    good = _runner("const_one")
    hanging = asyncio.ensure_future(runner.score(_item()))
    start = time.monotonic()
    results = await asyncio.gather(*(good.score(_item()) for _ in range(5)))
    assert results == [(1.0, "")] * 5
    assert time.monotonic() - start < TIMEOUT_S
    assert not hanging.done()
    assert (await hanging)[0] == 0.0


async def test_a_raising_function_scores_zero_with_the_exception_text() -> None:
    runner = _runner("raises", "const_one")
    value, error = await runner.score(_item(completion="xyz"))
    assert value == 1.0
    assert error == f"{HERE}:raises raised RuntimeError: cannot score 'xyz'"
    value, error = await _runner("not_a_number").score(_item())
    assert value == 0.0 and "ValueError" in error
    assert runner.failures == 1


async def test_functions_get_only_the_arguments_they_declare() -> None:
    SEEN.clear()
    await _runner("takes_two", "takes_all").score(_item())
    assert SEEN["takes_two"] == {"completion": "c", "answer": "yes"}
    assert set(SEEN["takes_all"]) == set(ARGUMENTS)
    assert SEEN["takes_all"]["metadata"] == {"k": 1}
    assert SEEN["takes_all"]["completion_ids"] == [3]


def test_load_function_errors_name_the_failing_part() -> None:
    with pytest.raises(ValueError, match=r"cannot import 'no_such_module_xyz'"):
        load_function("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match=r"'missing' is not a callable in tests\.unit\.test_reward"):
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
