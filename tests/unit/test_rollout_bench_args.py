"""benchmarks/rollout.py compares like for like: the bare engine's arguments are the role's
(built by the role's own function, with the sleep mode the role would choose), and a
difference is refused naming every differing argument."""

from __future__ import annotations

import pytest

from benchmarks.rollout import bare_engine_kwargs, check_same_args
from roles.generation.engine import engine_kwargs
from runtime.config_load import load_config
from runtime.paths import model_dir


def test_bare_arguments_are_the_roles() -> None:
    cfg = load_config("configs/tiny_cpu.yaml", ["run_dir=/tmp/x"])
    assert bare_engine_kwargs(cfg) == engine_kwargs(cfg.rollout.engine, str(model_dir(cfg)), sleep_mode=False)
    # A synchronous run colocated on a GPU: the role sleeps between steps, and so must the bare engine.
    sync = load_config("configs/bench_h200x1.yaml", ["rollout.max_staleness=0"])
    assert bare_engine_kwargs(sync)["enable_sleep_mode"] is True
    assert bare_engine_kwargs(load_config("configs/bench_h200x1.yaml"))["enable_sleep_mode"] is False


def test_different_arguments_are_refused_naming_each() -> None:
    same = {"seed": 0, "max_num_seqs": 256}
    check_same_args(same, dict(same))
    with pytest.raises(SystemExit, match=r"engine arguments differ \(enable_sleep_mode: bare <unset> vs role True, "
                                         r"max_num_seqs: bare 256 vs role 128\); not reporting a ratio"):  # fmt: skip
        check_same_args(same, {"seed": 0, "max_num_seqs": 128, "enable_sleep_mode": True})
