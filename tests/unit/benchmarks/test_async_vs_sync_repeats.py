"""benchmarks/async_vs_sync.py --repeats: the runs it plans (alternating, each with enough
measured steps, every one a valid config) and the spread it reports over them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.async_vs_sync import Policy, aggregate_repeats, parse_args, plan_runs
from runtime.config.load import load_config
from tests.conftest import ROOT

TINY = ROOT / "configs" / "tiny_cpu.yaml"


def _run(rate: float, **kw: float) -> dict[str, float]:
    return {"samples_per_s": rate, **kw}


def test_spread_of_rates_and_of_the_paired_ratio() -> None:
    repeats = [
        {"sync": _run(10.0, steps=20, tokens_per_s=100.0), "async": _run(18.0, tokens_per_s=150.0)},
        {"sync": _run(12.0, steps=21, tokens_per_s=100.0), "async": _run(18.0, tokens_per_s=110.0)},
        {"sync": _run(9.0, steps=22, tokens_per_s=100.0), "async": _run(20.0, tokens_per_s=120.0)},
    ]
    agg = aggregate_repeats(repeats)
    sync = agg["spread"]["sync"]["samples_per_s"]
    assert (sync["median"], sync["min"], sync["max"], sync["samples"]) == (10.0, 9.0, 12.0, [10.0, 12.0, 9.0])
    ratio = agg["spread"]["speedup"]
    assert ratio["samples"] == pytest.approx([1.8, 1.5, 20 / 9])  # each async run over the sync run beside it
    assert (ratio["median"], ratio["min"], ratio["max"]) == pytest.approx((1.8, 1.5, 20 / 9))
    tokens = agg["spread"]["speedup_tokens"]  # the ratio of trained tokens/s, repeat by repeat
    assert tokens["samples"] == pytest.approx([1.5, 1.1, 1.2]) and tokens["median"] == pytest.approx(1.2)
    assert agg["median_runs"]["sync"]["steps"] == 20  # the run whose rate is the median: a real run
    assert agg["median_runs"]["async"]["samples_per_s"] == 18.0
    only_sync = aggregate_repeats([{"sync": _run(1.0)}, {"sync": _run(3.0)}])
    assert "speedup" not in only_sync["spread"] and only_sync["median_runs"]["sync"]["samples_per_s"] == 1.0


def test_repeats_alternate_and_each_run_keeps_twenty_measured_steps(tmp_path: Path) -> None:
    args = parse_args(["--config", str(TINY), "--repeats", "3", "--staleness", "2", "rollout.n=4"])
    assert args.measured_steps == 20
    plans = plan_runs(TINY, load_config(TINY), args, Policy(1, 1.0, []), tmp_path)
    assert len(plans) == 3 and all(list(p) == ["sync", "async"] for p in plans)
    for rep, plan in enumerate(plans):
        sync, async_ = (load_config(TINY, plan[k]) for k in ("sync", "async"))
        assert (sync.run_dir, async_.run_dir) == (str(tmp_path / f"sync-{rep}"), str(tmp_path / f"async-{rep}"))
        # warm-up 2 + 20 measured (+ the async run's last max_staleness steps, which are not measured)
        assert (sync.trainer.total_steps, async_.trainer.total_steps) == (22, 24)
        assert sync.rollout.n == async_.rollout.n == 4
    single = parse_args(["--config", str(TINY)])
    assert single.measured_steps is None  # one repeat: the config's total_steps, as before
    (plan,) = plan_runs(TINY, load_config(TINY), single, Policy(1, 1.0, []), tmp_path)
    assert load_config(TINY, plan["sync"]).run_dir == str(tmp_path / "sync")
    assert load_config(TINY, plan["async"]).trainer.total_steps == 40


def test_bad_repeat_counts_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in ((["--repeats", "0"], "--repeats must be at least 1 (got 0)"),
                          (["--measured-steps", "0"], "--measured-steps must be at least 1 (got 0)")):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err


def test_gpus_are_refused_for_a_config_on_two_gpus_before_anything_runs(tmp_path: Path) -> None:
    from benchmarks.async_vs_sync import main

    with pytest.raises(SystemExit, match=r"places roles on GPUs \[0, 1\]: run it without --gpus"):
        main(["--config", str(ROOT / "configs" / "bench_h200x2.yaml"), "--gpus", "0,1", "--run-root", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []  # no model made, nothing launched
    assert parse_args(["--gpus", "0,1"]).gpus == ["0", "1"] and parse_args([]).gpus is None


def _fake_launches(monkeypatch: pytest.MonkeyPatch, rates: dict[str, list[float]]) -> list[str]:
    """`launch` replaced by one that writes a finished run's metrics.jsonl (every step at the
    next rate of its variant in `rates`); the launcher, vLLM and torch are not what is tested
    here, the bookkeeping over repeats is. Returns the run directories "launched"."""
    import benchmarks.async_vs_sync as bench
    from runtime.config.load import load_config as load

    launched: list[str] = []

    def launch(config: Path, overrides: list[str], log: Path, timeout: float, env: object) -> float:
        cfg = load(config, overrides)
        variant = Path(cfg.run_dir).name.split("-")[0]
        rate = rates[variant].pop(0)
        rec = {"step_s": 1.0, "samples_per_s": rate, "tokens_per_s": 10 * rate, "gen_busy_s": 0.5,
               "train_busy_s": 0.5, "weight_sync_s": 0.1, "staleness_mean": 0.0, "staleness_max": 0}  # fmt: skip
        lines = [{"step": s, "wall_s": float(s), **rec} for s in range(1, cfg.trainer.total_steps + 1)]
        Path(cfg.run_dir).mkdir(parents=True)
        (Path(cfg.run_dir) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        launched.append(Path(cfg.run_dir).name)
        return 1.0

    monkeypatch.setattr(bench, "launch", launch)
    monkeypatch.setattr(bench, "memory_figures", lambda cfg, records: {})
    monkeypatch.setattr(bench, "setup_policy", lambda cfg, root: Policy(10**6, 10.0, []))
    return launched


def test_add_to_keeps_the_earlier_repeats_and_reports_the_spread_over_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks.async_vs_sync import main

    launched = _fake_launches(monkeypatch, {"sync": [10.0, 10.0, 8.0], "async": [25.0, 15.0, 20.0]})
    common = ["--config", str(TINY), "--measured-steps", "3", "--staleness", "2", "rollout.n=4"]
    first = tmp_path / "first.json"
    monkeypatch.setenv("TANDEM_COMMIT", "aaaaaaa")
    main([*common, "--run-root", str(tmp_path / "a"), "--out", str(first)])  # one pair, as a plain run
    one = json.loads(first.read_text())
    assert "repeats" not in one and one["speedup"] == 2.5 and one["commit"] == "aaaaaaa" and one["host"]
    both = tmp_path / "both.json"
    monkeypatch.setenv("TANDEM_COMMIT", "bbbbbbb")
    main([*common, "--repeats", "2", "--add-to", str(first), "--run-root", str(tmp_path / "b"), "--out", str(both)])
    assert launched == ["sync", "async", "sync-1", "async-1", "sync-2", "async-2"]  # numbered after the earlier one
    result = json.loads(both.read_text())
    assert [r["repeat"] for r in result["repeats"]] == [0, 1, 2]
    assert [r["commit"] for r in result["repeats"]] == ["aaaaaaa", "bbbbbbb", "bbbbbbb"]
    assert [r["speedup"] for r in result["repeats"]] == [2.5, 1.5, 2.5]
    ratio = result["spread"]["speedup"]
    assert (ratio["median"], ratio["min"], ratio["max"]) == (2.5, 1.5, 2.5) and result["speedup"] == 2.5
    assert result["spread"]["sync"]["samples_per_s"]["samples"] == [10.0, 10.0, 8.0]
    # A third invocation on top of the repeats file keeps all three.
    again = tmp_path / "again.json"
    _fake_launches(monkeypatch, {"sync": [10.0], "async": [30.0]})
    main([*common, "--add-to", str(both), "--run-root", str(tmp_path / "c"), "--out", str(again)])
    assert [r["speedup"] for r in json.loads(again.read_text())["repeats"]] == [2.5, 1.5, 2.5, 3.0]


def test_add_to_refuses_a_file_measured_otherwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.async_vs_sync import main

    _fake_launches(monkeypatch, {"sync": [10.0], "async": [20.0]})
    common = ["--config", str(TINY), "--measured-steps", "3", "--staleness", "2"]
    first = tmp_path / "first.json"
    main([*common, "rollout.n=4", "--run-root", str(tmp_path / "a"), "--out", str(first)])
    for argv, message in (
        (["rollout.n=8"], r"overrides was \['rollout.n=4'\], now \['rollout.n=8'\]"),
        (["rollout.n=4", "--staleness", "4"], "staleness was 2, now 4"),
        (["rollout.n=4", "--measured-steps", "5"], r"repeat 0's sync run kept 3 measured steps, now 5"),
        (["rollout.n=4", "--only", "sync"], r"repeat 0 ran \['async', 'sync'\], now \['sync'\]"),
    ):
        with pytest.raises(SystemExit, match=message):
            main([*common, *argv, "--add-to", str(first), "--run-root", str(tmp_path / "b")])
    (tmp_path / "other.json").write_text('{"benchmark": "rollout"}')
    with pytest.raises(SystemExit, match=r"not a result of benchmarks/async_vs_sync\.py"):
        main([*common, "--add-to", str(tmp_path / "other.json"), "--run-root", str(tmp_path / "b")])
