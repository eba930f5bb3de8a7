"""Options that the chosen mode ignores are refused at config load (runtime/config/validate.py
`check_inert_options`), one line naming the field; the same value in a mode that reads
it, or the default written out, passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config.load import load_config
from runtime.config.validate import check_inert_options
from runtime.errors import ConfigError
from runtime.preflight.environment import check_launch
from tests.conftest import ROOT

TINY = ROOT / "configs" / "tiny_cpu.yaml"

# (the inert setting, the mode that makes it act, the line's start)
CASES = [
    (["trainer.loss.clip_ratio_c=5"], ["trainer.loss.mode=dual-clip"], "trainer.loss.clip_ratio_c=5 has no effect"),
    (["trainer.loss.clip_ratio_c=5", "trainer.loss.mode=gspo"], ["trainer.loss.mode=dual-clip"],
     "trainer.loss.clip_ratio_c=5 has no effect: it acts only with trainer.loss.mode=dual-clip (mode is gspo)"),
    (["trainer.loss.importance_cap=2", "trainer.loss.rollout_correction.mode=mask"],
     ["trainer.loss.rollout_correction.mode=truncate"], "trainer.loss.importance_cap=2 has no effect"),
    (["trainer.loss.rollout_correction.mask_low=0.1"], ["trainer.loss.rollout_correction.mode=mask"],
     "trainer.loss.rollout_correction.mask_low=0.1 has no effect"),
    (["trainer.loss.rollout_correction.mask_high=3"], ["trainer.loss.rollout_correction.mode=mask"],
     "trainer.loss.rollout_correction.mask_high=3 has no effect"),
    (["trainer.loss.norm_tokens=64"], ["trainer.loss.agg=seq-mean-token-sum-norm"],
     "trainer.loss.norm_tokens=64 has no effect"),
    (["algorithm.std=population", "algorithm.advantage=rloo"], ["algorithm.advantage=grpo"],
     "algorithm.std=population has no effect"),
    (["algorithm.std=population", "algorithm.norm_by_std=false"], ["algorithm.norm_by_std=true"],
     "algorithm.std=population has no effect"),
    (["algorithm.norm_by_std=false", "algorithm.advantage=dr_grpo"], ["algorithm.advantage=grpo"],
     "algorithm.norm_by_std=false has no effect"),
    (["algorithm.gamma=0.9"], ["algorithm.advantage=reinforce_pp", "rollout.n=1"], "algorithm.gamma=0.9 has no effect"),
    (["algorithm.lam=0.5"], ["algorithm.advantage=gae"], "algorithm.lam=0.5 has no effect"),
    (["algorithm.whiten_advantages=false"], ["algorithm.advantage=gae"],
     "algorithm.whiten_advantages=false has no effect"),
]  # fmt: skip


@pytest.mark.parametrize(("inert", "acting", "line"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_an_option_the_mode_ignores_is_refused_in_one_line(inert: list[str], acting: list[str], line: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_launch(load_config(TINY, inert))
    message = str(err.value)
    assert message.startswith(line) and message.endswith("; remove it") and "\n" not in message
    check_inert_options(load_config(TINY, [*inert, *acting]))  # the mode that reads it accepts it


@pytest.mark.parametrize(
    "written",
    [
        "trainer.loss.clip_ratio_c=3.0",
        "trainer.loss.importance_cap=5.0",
        "algorithm.std=unbiased",
        "algorithm.lam=0.95",
        "algorithm.gamma=1.0",
        "algorithm.whiten_advantages=true",
        "trainer.loss.norm_tokens=0",
    ],
)
def test_the_default_written_out_is_not_refused(written: str) -> None:
    check_inert_options(
        load_config(TINY, [written, "algorithm.advantage=rloo", "trainer.loss.rollout_correction.mode=mask"])
    )


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_no_shipped_recipe_sets_an_inert_option(path: Path) -> None:
    check_inert_options(load_config(path))
