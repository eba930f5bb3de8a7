"""A resume compares the checkpoint's settings with its own (runtime/checkpoints/resume_settings.py):
`rollout.n=4` or a smaller batch on resume stalled with no log line
until killed, and a changed advantage estimator, staleness, data path or seed was taken
without a word."""

from __future__ import annotations

import msgspec

from runtime.checkpoints.resume_settings import compare, settings
from runtime.config import RunConfig


def _with(**changes: object) -> dict[str, object]:
    flat = settings(RunConfig())
    flat.update(changes)
    return flat


def test_settings_the_saved_state_depends_on_are_refused_naming_each() -> None:
    saved = settings(RunConfig())
    refused, accepted = compare(saved, _with(**{"rollout.n": 4, "trainer.prompts_per_step": 3}))
    assert refused.startswith("the checkpoint's saved state depends on settings this run changes: ")
    assert f"rollout.n {saved['rollout.n']} -> 4 (the group size)" in refused
    assert f"trainer.prompts_per_step {saved['trainer.prompts_per_step']} -> 3 (the batch)" in refused
    assert "resume=fresh" in refused and "\n" not in refused and accepted == ""


def test_other_changes_are_accepted_and_named_in_one_line() -> None:
    saved = settings(RunConfig())
    now = _with(**{"seed": 7, "algorithm.advantage": "rloo", "rollout.max_staleness": 4, "run_dir": "/elsewhere"})
    refused, accepted = compare(saved, now)
    assert refused == ""
    assert accepted == (
        f"algorithm.advantage {saved['algorithm.advantage']} -> rloo, "
        f"rollout.max_staleness {saved['rollout.max_staleness']} -> 4, seed {saved['seed']} -> 7"
    )


def test_an_unchanged_config_and_a_checkpoint_without_settings_say_nothing() -> None:
    assert compare(settings(RunConfig()), settings(RunConfig())) == ("", "")
    assert compare(None, _with(**{"rollout.n": 2})) == ("", "")


def test_settings_round_trip_through_a_json_manifest() -> None:
    import json

    flat = settings(msgspec.convert({"rollout": {"n": 3}}, RunConfig))
    assert compare(json.loads(json.dumps(flat)), flat) == ("", "")
