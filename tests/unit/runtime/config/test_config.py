"""Config loading: overrides, aliases, one-line errors naming the key, `base:` layering,
the YAML round trip, every recipe in configs/, the generated reference, cross-field checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config import MixedPrecisionConfig, PlacementEntry, RunConfig
from runtime.config.load import config_docs, load_config, parse_override, to_yaml
from runtime.errors import ConfigError
from runtime.identity.addresses import channel_options
from runtime.preflight import environment
from runtime.preflight.environment import check_launch
from tests.conftest import ROOT
from transport.endpoint import ChannelOptions


def test_defaults_without_a_file() -> None:
    cfg = load_config(None)
    assert cfg == RunConfig(run_dir="runs/run")


def test_overrides_of_every_scalar_kind() -> None:
    cfg = load_config(
        None,
        [
            "rollout.max_staleness=3",
            "trainer.optim.lr=0.002",
            "trainer.optim.weight_decay=1e-2",  # YAML 1.1 reads this as a string
            "rollout.ignore_eos=true",
            "rollout.stop_token_ids=[7, 9]",
            "fsdp.ignored_modules=[lm_head, 'embed*']",
            "name=exp1",
        ],
    )
    assert cfg.rollout.max_staleness == 3
    assert cfg.trainer.optim.lr == 0.002
    assert cfg.trainer.optim.weight_decay == 0.01
    assert cfg.rollout.ignore_eos is True
    assert cfg.rollout.stop_token_ids == [7, 9]
    assert cfg.fsdp.ignored_modules == ["lm_head", "embed*"]
    assert (cfg.name, cfg.run_dir) == ("exp1", "runs/exp1")


def test_mixed_precision_set_and_nulled() -> None:
    cfg = load_config(None, ["fsdp.mixed_precision.param_dtype=float16"])
    assert cfg.fsdp.mixed_precision == MixedPrecisionConfig(param_dtype="float16", reduce_dtype="float32")
    assert (
        load_config(
            None, ["fsdp.mixed_precision.param_dtype=float16", "fsdp.mixed_precision=null"]
        ).fsdp.mixed_precision
        is None
    )


def test_trainer_fsdp_is_an_alias_of_fsdp() -> None:
    assert parse_override("trainer.fsdp.cpu_offload=true") == ("fsdp.cpu_offload", True)
    cfg = load_config(None, ["trainer.fsdp.sharding_strategy=NO_SHARD", "trainer.fsdp.hybrid_shard_size=4"])
    assert (cfg.fsdp.sharding_strategy, cfg.fsdp.hybrid_shard_size) == ("NO_SHARD", 4)


def test_override_without_equals_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"'rollout\.n' is not key=value"):
        load_config(None, ["rollout.n"])


def test_unknown_top_level_key_names_the_full_key() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["foo.bar=1"])
    msg = str(err.value)
    assert "'foo.bar'" in msg
    assert "valid keys under the top level" in msg and "rollout" in msg and "trainer" in msg


def test_unknown_nested_key_lists_the_valid_keys() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.engine.nope=1"])
    msg = str(err.value)
    assert "'rollout.engine.nope'" in msg
    assert "valid keys under rollout.engine:" in msg and "max_model_len" in msg and "tensor_parallel_size" in msg
    assert "\n" not in msg


def test_bad_enum_value_lists_the_choices() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["fsdp.sharding_strategy=FULL"])
    msg = str(err.value)
    assert "'fsdp.sharding_strategy'" in msg and "'FULL'" in msg
    assert "valid choices: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD" in msg


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("rollout.max_staleness=-1", ">= 0"),
        ("rollout.max_staleness=two", "Expected `int`"),
        ("rollout.top_p=0", "> 0.0"),
        ("rollout.engine.gpu_memory_utilization=1.5", "<= 0.99"),
        ("trainer.total_steps=[1]", "Expected `int`"),
    ],
)
def test_bad_type_or_range_names_the_key(override: str, expected: str) -> None:
    key = override.partition("=")[0]
    with pytest.raises(ConfigError, match=f"bad value for config key '{key}'") as err:
        load_config(None, [override])
    assert expected in str(err.value)


def test_unknown_key_in_a_yaml_file_names_its_dotted_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  engine:\n    max_model_lenn: 64\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout\.engine\.max_model_lenn'.*max_model_len"):
        load_config(path)
    path.write_text("placement:\n  - {role: controller}\n  - {role: trainer, gpus: [0]}\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'placement\.1\.gpus'.*devices"):
        load_config(path)


def test_yaml_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(path)


def test_base_layering_child_wins_and_names_the_run(tmp_path: Path) -> None:
    (tmp_path / "parent.yaml").write_text(
        "name: parent\nseed: 7\nrollout:\n  n: 4\n  max_staleness: 2\n  engine: {max_model_len: 300}\n"
    )
    (tmp_path / "sub").mkdir()
    child = tmp_path / "sub" / "child.yaml"
    child.write_text("base: ../parent.yaml\nrollout:\n  n: 2\n  engine: {seed: 5}\n")
    cfg = load_config(child, ["rollout.max_tokens=20"])
    assert cfg.name == "child"  # not the parent's name: the child file's stem
    assert cfg.seed == 7
    assert (cfg.rollout.n, cfg.rollout.max_staleness, cfg.rollout.max_tokens) == (2, 2, 20)
    assert (cfg.rollout.engine.max_model_len, cfg.rollout.engine.seed) == (300, 5)  # merged, not replaced
    child.write_text("base: ../parent.yaml\nname: mine\n")
    assert load_config(child).name == "mine"


def test_to_yaml_round_trip(tmp_path: Path) -> None:
    cfg = load_config(
        ROOT / "configs" / "tiny_cpu.yaml",
        ["fsdp.mixed_precision.param_dtype=bfloat16", "trainer.optim.lr=3e-6", "rollout.stop_token_ids=[1]"],
    )
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_parses_and_passes_checks(path: Path) -> None:
    cfg = load_config(path)
    check_launch(cfg)
    assert cfg.name


def test_config_reference_is_current() -> None:
    assert (ROOT / "docs" / "config.md").read_text() == config_docs()


def _megatron(*overrides: str) -> RunConfig:
    return load_config(None, ["trainer.backend=megatron", "trainer.device=cuda", *overrides])


@pytest.fixture
def megatron_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cross-field checks below hold whether or not megatron-core is installed here."""
    monkeypatch.setattr(environment, "megatron_core_installed", lambda: True)


def test_transport_keys_reach_the_channel_options(tmp_path: Path) -> None:
    """The channel defaults are the config defaults, and overrides reach the sockets."""
    assert channel_options(RunConfig(), tmp_path) == ChannelOptions()
    cfg = load_config(None, ["transport.peer_timeout_s=3", "transport.hwm=7", "transport.heartbeat_s=0.5"])
    opts = channel_options(cfg, tmp_path)
    assert (opts.peer_timeout_s, opts.hwm, opts.heartbeat_s) == (3.0, 7, 0.5)


def test_megatron_backend_needs_megatron_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(environment, "megatron_core_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"trainer\.backend=megatron needs megatron-core: pip install"):
        check_launch(_megatron("fsdp.use_fsdp=false"))


@pytest.mark.usefixtures("megatron_engine")
@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (("algorithm.kl.enabled=true",), r"algorithm\.kl\.use=loss needs a reference policy"),
        (("trainer.loss.entropy_coef=0.01",), r"trainer\.loss\.entropy_coef > 0 is not supported"),
        (
            ("trainer.megatron.model_provider=mymodels.build",),
            r"model_provider 'mymodels\.build' must be module:function",
        ),
        (("trainer.device=cpu",), r"needs trainer\.device=cuda"),
        (("fsdp.use_fsdp=false", "fsdp.cpu_offload=true"), r"fsdp\.cpu_offload does not apply"),
    ],
)
def test_megatron_refuses_what_it_cannot_do(overrides: tuple[str, ...], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        check_launch(_megatron("fsdp.use_fsdp=false", *overrides))


@pytest.mark.usefixtures("megatron_engine")
def test_distributed_optimizer_checkpoints_are_accepted() -> None:
    check_launch(
        _megatron("fsdp.use_fsdp=false", "trainer.megatron.use_distributed_optimizer=true", "checkpoint.every=5")
    )


def _megatron_critic(*overrides: str) -> RunConfig:
    return load_config(
        ROOT / "configs" / "ppo_hybridflow.yaml", ["critic.backend=megatron", "trainer.device=cuda", *overrides]
    )


@pytest.mark.usefixtures("megatron_engine")
@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (
            ("critic.megatron.pipeline_model_parallel_size=2",),
            r"critic\.megatron\.pipeline_model_parallel_size must be 1",
        ),
        (("critic.megatron.tensor_model_parallel_size=2",), r"critic world size 1 is not a multiple of .* = 2"),
        (("critic.megatron.model_provider=m:f",), r"critic\.megatron\.model_provider is not supported"),
        (("trainer.device=cpu",), r"critic\.backend=megatron needs trainer\.device=cuda"),
    ],
)
def test_megatron_critic_refuses_what_it_cannot_do(overrides: tuple[str, ...], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        check_launch(_megatron_critic(*overrides))
    check_launch(_megatron_critic())  # an FSDP2 actor beside a Megatron critic


def test_megatron_critic_needs_megatron_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(environment, "megatron_core_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"critic\.backend=megatron needs megatron-core"):
        check_launch(_megatron_critic())


@pytest.mark.usefixtures("megatron_engine")
def test_megatron_refuses_fsdp_full_shard() -> None:
    with pytest.raises(
        ConfigError, match=r"fsdp\.use_fsdp=false or fsdp\.sharding_strategy=NO_SHARD \(got FULL_SHARD\)"
    ):
        check_launch(_megatron())
    check_launch(_megatron("fsdp.use_fsdp=false"))
    check_launch(_megatron("fsdp.sharding_strategy=NO_SHARD"))


@pytest.mark.usefixtures("megatron_engine")
def test_megatron_world_size_must_be_a_multiple_of_tp_times_pp() -> None:
    # The default placement has 2 trainer ranks.
    bad = _megatron(
        "fsdp.use_fsdp=false",
        "trainer.megatron.tensor_model_parallel_size=2",
        "trainer.megatron.pipeline_model_parallel_size=2",
    )
    with pytest.raises(ConfigError, match=r"trainer world size 2 is not a multiple of .* = 4"):
        check_launch(bad)
    check_launch(_megatron("fsdp.use_fsdp=false", "trainer.megatron.tensor_model_parallel_size=2"))


def test_file_source_needs_a_path() -> None:
    with pytest.raises(ConfigError, match=r"data\.source=file needs data\.path"):
        check_launch(load_config(None, ["data.source=file"]))


def test_max_tokens_must_leave_room_in_the_model_length() -> None:
    with pytest.raises(
        ConfigError, match=r"rollout\.max_tokens \(64\) must be below rollout\.engine\.max_model_len \(64\)"
    ):
        check_launch(load_config(None, ["rollout.max_tokens=64", "rollout.engine.max_model_len=64"]))
    check_launch(load_config(None, ["rollout.max_tokens=63", "rollout.engine.max_model_len=64"]))


def test_critic_without_gae_and_bad_reward_spec_are_refused() -> None:
    cfg = load_config(None)
    cfg.placement = [PlacementEntry(role="controller"), PlacementEntry(role="critic")]
    with pytest.raises(ConfigError, match=r"critic but algorithm\.advantage is not gae"):
        check_launch(cfg)
    with pytest.raises(ConfigError, match=r"'mymodule\.fn' must be module:function"):
        check_launch(load_config(None, ["reward.functions=[mymodule.fn]"]))


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_group_estimators_refuse_groups_of_one(estimator: str) -> None:
    cfg = load_config(None, [f"algorithm.advantage={estimator}", "rollout.n=1"])
    with pytest.raises(ConfigError, match=rf"algorithm.advantage={estimator} needs rollout.n >= 2"):
        check_launch(cfg)
    check_launch(load_config(None, ["algorithm.advantage=reinforce_pp", "rollout.n=1"]))
