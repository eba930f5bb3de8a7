"""The run's bound on failed sampling (roles/controller/error_rate.py): an environment that
fails some samples costs their groups; one that fails most ends the run naming the first
error, where it used to spin forever, dropping every group."""

from __future__ import annotations

from roles.controller.error_rate import ErrorRate


def test_failures_up_to_the_fraction_cost_only_their_groups() -> None:
    rate = ErrorRate(0.5, window=4)
    assert [rate.record(e) for e in ["boom", "boom", "", "", "boom", "", "boom", ""]] == [""] * 8


def test_a_window_mostly_failed_ends_the_run_naming_the_first_error() -> None:
    rate = ErrorRate(0.5, window=4)
    causes = [rate.record(e) for e in ["", "env raised A", "env raised B", "env raised C"]]
    assert causes[:3] == ["", "", ""]
    assert causes[3] == (
        "3 of the last 4 prompt groups failed sampling (more than rollout.max_error_fraction=0.5); first: env raised A"
    )


def test_failures_before_the_window_fills_never_end_the_run() -> None:
    rate = ErrorRate(0.0, window=16)
    assert all(rate.record("boom") == "" for _ in range(15))
    assert rate.record("boom").startswith("16 of the last 16")
