"""benchmarks/rollout.py compares like for like: the bare engine's arguments are the role's
(built by the role's own function, with the sleep mode the role would choose) plus what
`--bare-arg` adds, and every argument that differs is named in the JSON."""

from __future__ import annotations

import pytest

from benchmarks.rollout import bare_args, bare_engine_kwargs, differing_args
from roles.generation.engine import engine_kwargs
from runtime.config.load import load_config
from runtime.identity.paths import model_dir


def test_bare_arguments_are_the_roles() -> None:
    cfg = load_config("configs/tiny_cpu.yaml", ["run_dir=/tmp/x"])
    assert bare_engine_kwargs(cfg) == engine_kwargs(cfg.rollout.engine, str(model_dir(cfg)), sleep_mode=False)
    # A synchronous run colocated on a GPU: the role sleeps between steps, and so must the bare engine.
    sync = load_config("configs/bench_1.5b.yaml", ["rollout.max_staleness=0"])
    assert bare_engine_kwargs(sync)["enable_sleep_mode"] is True
    assert bare_engine_kwargs(load_config("configs/bench_1.5b.yaml"))["enable_sleep_mode"] is False
    # A rollout that serves agents loads vLLM's tokenizer (its tool-call grammars need it), and so must the bare one.
    assert bare_engine_kwargs(cfg)["skip_tokenizer_init"] is True
    agent = load_config("configs/agent_tiny_cpu.yaml", ["run_dir=/tmp/x"])
    assert bare_engine_kwargs(agent)["skip_tokenizer_init"] is False


def test_bare_args_add_to_the_roles_and_every_difference_is_named() -> None:
    cfg = load_config("configs/tiny_cpu.yaml", ["run_dir=/tmp/x"])
    role = bare_engine_kwargs(cfg)
    bare = bare_args(cfg, ["max_num_batched_tokens=16384", "enable_prefix_caching=false"])
    assert bare == {**role, "max_num_batched_tokens": 16384, "enable_prefix_caching": False}
    assert differing_args(bare, role) == [
        f"enable_prefix_caching: bare False vs role {role['enable_prefix_caching']!r}",
        "max_num_batched_tokens: bare 16384 vs role <unset>",
    ]
    assert differing_args(role, dict(role)) == []
    with pytest.raises(SystemExit, match="--bare-arg 'oops' is not KEY=VALUE"):
        bare_args(cfg, ["oops"])


def test_the_benchmark_process_restarts_in_the_role_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """glibc reads GLIBC_TUNABLES only at process start: setting it in os.environ would reach
    the engine's children but not the process handling the bare engine's outputs."""
    import os
    import sys

    from benchmarks.rollout import run_in_role_environment
    from runtime.launch.env import ROLE_ENV_DEFAULTS

    calls: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: calls.append((path, argv, env)))
    monkeypatch.setattr(sys, "argv", ["benchmarks/rollout.py", "--quick"])
    for key in ROLE_ENV_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # a user's value wins
    run_in_role_environment()
    assert len(calls) == 1
    path, argv, env = calls[0]
    assert path == sys.executable and argv == [sys.executable, "benchmarks/rollout.py", "--quick"]
    assert env["GLIBC_TUNABLES"] == ROLE_ENV_DEFAULTS["GLIBC_TUNABLES"] and env["OMP_NUM_THREADS"] == "4"
    monkeypatch.setattr(os, "environ", dict(env))  # the restarted process: nothing left to set
    run_in_role_environment()
    assert len(calls) == 1


def test_a_gpu_share_two_engines_cannot_hold_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both engines are resident at once: a share over half the GPU is refused naming the field."""
    import sys

    from benchmarks import rollout

    monkeypatch.setattr(rollout, "gpu_present", lambda: True)
    monkeypatch.setattr(rollout, "run_in_role_environment", lambda: None)
    # The refusal comes before the benchmark sets up logging: that would point this test
    # process's global logger at a stderr capture closed after the test (5 later tests failed).
    monkeypatch.setattr(rollout, "setup_logging", lambda *a, **k: pytest.fail("logging set up before the refusal"))
    monkeypatch.setattr(rollout.tempfile, "mkdtemp", lambda **k: pytest.fail("run directory made before the refusal"))
    monkeypatch.setattr(sys, "argv", ["rollout.py", "--config", "configs/bench_h200x2.yaml"])
    with pytest.raises(SystemExit) as exit_info:
        rollout.main()
    assert exit_info.value.code == 2
    assert "rollout.engine.gpu_memory_utilization is 0.85" in capsys.readouterr().err
