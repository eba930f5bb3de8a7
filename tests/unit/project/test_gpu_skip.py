"""The GPU tests skip with their reason where the machine lacks the GPUs they need
(tests/helpers/gpu_skip.py): none for a `gpu` test, fewer than `n` for a `gpus(n)` one."""

from __future__ import annotations

import pytest

from tests.helpers.gpu_skip import gpu_skip_reason

pytest_plugins = ["pytester"]

TESTS = """
import pytest

def test_cpu():
    pass

@pytest.mark.gpu
def test_one_gpu():
    pass

@pytest.mark.gpu
@pytest.mark.gpus(2)
def test_two_gpus():
    pass
"""


@pytest.fixture
def items(pytester: pytest.Pytester) -> dict[str, pytest.Item]:
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\nmarkers =\n    gpu: x\n    gpus(n): y\n")
    return {item.name: item for item in pytester.getitems(TESTS)}


def test_a_cpu_machine_skips_every_gpu_test_and_runs_the_rest(items: dict[str, pytest.Item]) -> None:
    reasons = {name: gpu_skip_reason(item, 0) for name, item in items.items()}
    assert reasons == {
        "test_cpu": None,
        "test_one_gpu": "needs an NVIDIA GPU (marker gpu)",
        "test_two_gpus": "needs an NVIDIA GPU (marker gpu)",
    }


def test_one_gpu_skips_the_two_gpu_tests_naming_what_is_visible(items: dict[str, pytest.Item]) -> None:
    reasons = {name: gpu_skip_reason(item, 1) for name, item in items.items()}
    assert reasons == {
        "test_cpu": None,
        "test_one_gpu": None,
        "test_two_gpus": "needs 2 NVIDIA GPUs (marker gpus(2)); 1 is visible",
    }


def test_two_gpus_run_everything(items: dict[str, pytest.Item]) -> None:
    assert all(gpu_skip_reason(item, 2) is None for item in items.values())


def test_the_two_gpu_modules_carry_the_marker() -> None:
    """What needs two GPUs (a trainer or rollout on GPU 1, two NCCL ranks) says so."""
    from tests.gpu import test_gpu_run, test_megatron, test_weight_nccl

    for module in (test_gpu_run, test_megatron, test_weight_nccl):
        marks = module.pytestmark if isinstance(module.pytestmark, list) else [module.pytestmark]
        assert any(m.name == "gpus" and m.args == (2,) for m in marks), module.__name__
