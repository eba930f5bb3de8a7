"""The behaviour / proximal mismatch guard (roles/controller/mismatch.py): judged only at
staleness 0, one warning per run above `mismatch_warn`, the run ended above
`mismatch_stop` with a cause naming the step, the figure and the key."""

from __future__ import annotations

import pytest

from roles.controller.mismatch import MismatchGuard
from runtime.role import FatalError


def test_bf16_noise_passes_and_a_far_figure_warns_once() -> None:
    guard = MismatchGuard(warn=0.02, stop=0.0)
    guard.check(1, 9.6e-4, staleness_max=0)  # the 3B run's figure on an H200
    assert not guard.warned
    guard.check(2, 1.4, staleness_max=0)  # the padded-vocabulary fault's figure
    assert guard.warned
    guard.check(3, 1.4, staleness_max=0)  # no stop set: the run goes on


def test_over_the_stop_ends_the_run_naming_it() -> None:
    guard = MismatchGuard(warn=0.02, stop=0.5)
    guard.check(1, 0.3, staleness_max=0)
    with pytest.raises(FatalError, match=r"^step 4: kl_behaviour_proximal 1.4 at staleness 0 is over "
                                         r"algorithm.mismatch_stop=0.5: "):  # fmt: skip
        guard.check(4, 1.4, staleness_max=0)


def test_stale_steps_and_missing_metrics_are_not_judged() -> None:
    guard = MismatchGuard(warn=0.02, stop=0.5)
    guard.check(1, 3.0, staleness_max=1)  # the policy's own change since the samples
    guard.check(2, None, staleness_max=0)
    assert not guard.warned


def test_an_agent_runs_warning_explains_the_grammar_gap_and_suggests_no_stop() -> None:
    """docs/ecosystem.md's own agent (tool_choice="required") got the hint "engine numerics
    only ...; set algorithm.mismatch_stop to end such a run", where the page says the gap is
    the grammar's and to leave mismatch_stop off."""
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        MismatchGuard(warn=0.02, stop=0.0, agent=True).check(1, 2.33, staleness_max=0)
        MismatchGuard(warn=0.02, stop=0.0).check(1, 2.33, staleness_max=0)
    agent, plain = (line["hint"] for line in logs if line["event"] == "policy_mismatch")
    assert "grammar" in agent and "expected" in agent and "mismatch_stop" not in agent
    assert "numerics only" not in agent.split(";")[0]
    assert "engine numerics only" in plain and "mismatch_stop" in plain
