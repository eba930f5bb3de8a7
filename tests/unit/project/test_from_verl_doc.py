"""docs/from-verl.md cannot rot: every Tandem key its tables name is a key of the config
schema (the rows of `tandem config-docs`), and every `key=value` it gives is accepted by
the config loader."""

from __future__ import annotations

import re

from runtime.config.load import config_docs, load_config
from tests.conftest import ROOT

PAGE = ROOT / "docs" / "from-verl.md"


def schema_keys() -> set[str]:
    return set(re.findall(r"^\| `([^`]+)` \|", config_docs(), re.M))


def mapping_rows() -> list[tuple[str, str]]:
    """(verl column, Tandem column) of every table row below a `| verl key | Tandem key |` header."""
    rows, in_table = [], False
    for line in PAGE.read_text().splitlines():
        if line.startswith("| verl key | Tandem key |"):
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.append((cells[0], cells[1]))
    return rows


def test_the_page_has_the_keys_verl_users_ask_for() -> None:
    verl = " ".join(v for v, _ in mapping_rows())
    for key in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "actor.optim.lr", "clip_ratio_low",
                "clip_ratio_high", "loss_agg_mode", "use_kl_loss", "kl_loss_coef", "kl_loss_type", "entropy_coeff",
                "rollout.n", "gpu_memory_utilization", "rollout.temperature", "adv_estimator", "train_batch_size",
                "max_prompt_length", "max_response_length", "total_training_steps", "save_freq", "test_freq",
                "critic.optim.lr"):  # fmt: skip
        assert key in verl, key


def test_every_tandem_key_on_the_page_exists() -> None:
    keys = schema_keys()
    rows = mapping_rows()
    assert len(rows) > 60
    named = 0
    for verl, tandem in rows:
        assert verl.startswith("`"), verl
        if tandem == "none":
            continue
        items = re.findall(r"`([^`]+)`", tandem)
        assert items and re.sub(r"`[^`]+`|,|\s", "", tandem) == "", f"{verl}: '{tandem}' is not backticked keys"
        for item in items:
            key = item.partition("=")[0]
            assert key in keys, f"{verl}: {key} is not a Tandem config key"
            named += 1
    assert named > 50


def test_every_setting_on_the_page_loads() -> None:
    settings = [item for _, t in mapping_rows() for item in re.findall(r"`([^`]+=[^`]+)`", t)]
    assert settings
    for item in settings:
        load_config(None, [item])
