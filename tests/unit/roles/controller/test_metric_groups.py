"""The dashboards' metric groups: every step metric a run writes lands in one of the
groups verl/TRL users expect, and docs/metrics.md prints the rules the code applies."""

from __future__ import annotations

import json

from roles.controller.metric_groups import grouped, rules_table
from roles.controller.metrics import REQUIRED_KEYS, dashboard_values
from tests.conftest import ROOT

GROUPS = {"actor", "critic", "rollout", "timing", "weights", "val"}


def test_every_metric_of_a_recorded_run_has_a_group() -> None:
    keys = set(REQUIRED_KEYS)
    for line in (ROOT / "tests/data/tiny_run/metrics.jsonl").read_text().splitlines():
        keys |= set(json.loads(line)) - {"kind", "step"}
    for key in keys:
        group, _, rest = grouped(key).partition("/")
        assert group in GROUPS and rest, key


def test_names_a_verl_user_expects() -> None:
    assert grouped("loss") == "actor/loss" and grouped("grad_norm") == "actor/grad_norm"
    assert grouped("reward_mean") == "rollout/reward_mean" and grouped("staleness_max") == "rollout/staleness_max"
    assert grouped("samples_per_s") == "timing/samples_per_s" and grouped("train_busy_s") == "timing/train_busy_s"
    assert grouped("weight_sync_s") == "weights/weight_sync_s"
    assert grouped("critic_value_loss") == "critic/value_loss"
    assert grouped("val/pass@4") == "val/pass@4"


def test_the_docs_print_the_rules_the_code_applies() -> None:
    assert rules_table() in (ROOT / "docs/metrics.md").read_text()


def test_the_dashboards_get_grouped_names_and_no_step() -> None:
    record = {k: 1.0 for k in REQUIRED_KEYS} | {"step": 7, "critic_value_loss": 0.5, "note": "text", "ok": True}
    values = dashboard_values(record)
    assert values["actor/loss"] == 1.0 and values["rollout/reward_mean"] == 1.0
    assert values["timing/samples_per_s"] == 1.0 and values["weights/weight_sync_s"] == 1.0
    assert values["critic/value_loss"] == 0.5
    assert all("/" in k for k in values) and not any(k.endswith(("step", "note", "ok")) for k in values)
