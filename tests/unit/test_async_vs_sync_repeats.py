"""benchmarks/async_vs_sync.py --repeats: the runs it plans (alternating, each with enough
measured steps, every one a valid config) and the spread it reports over them."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.async_vs_sync import Policy, aggregate_repeats, parse_args, plan_runs
from runtime.config_load import load_config

ROOT = Path(__file__).resolve().parents[2]
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
