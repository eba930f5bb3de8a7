"""GPU placement checks: requested GPUs exist on the node, the GPU memory claims of the
processes sharing a GPU fit, CPU recipes pass on a machine without GPU, and the 2x H200
benchmark recipe loads and validates anywhere."""

from __future__ import annotations

import pytest

from runtime.config import PlacementEntry, RunConfig
from runtime.config.gpu_share import check_gpu_memory, gpu_claims
from runtime.config.load import load_config
from runtime.errors import ConfigError
from runtime.preflight.environment import check_launch
from runtime.preflight.gpus import check_gpu_devices
from tests.conftest import ROOT

CONTROLLER, REWARD = PlacementEntry(role="controller"), PlacementEntry(role="reward")


def _cfg(*placement: PlacementEntry, util: float = 0.5, device: str = "auto", advantage: str = "grpo") -> RunConfig:
    cfg = load_config(
        None,
        [
            f"rollout.engine.gpu_memory_utilization={util}",
            f"trainer.device={device}",
            f"algorithm.advantage={advantage}",
        ],
    )
    cfg.placement = [CONTROLLER, *placement, REWARD]
    return cfg


def _split(util: float = 0.85) -> RunConfig:
    """Rollout on GPU 0, trainer on GPU 1 (placement[1] and placement[2])."""
    return _cfg(
        PlacementEntry(role="rollout", devices=[0]), PlacementEntry(role="trainer", count=1, devices=[1]), util=util
    )


@pytest.mark.parametrize("name", ["tiny_cpu.yaml", "ppo_hybridflow.yaml", "grpo_gsm8k.yaml"])
def test_cpu_recipes_pass_without_a_gpu(name: str) -> None:
    cfg = load_config(ROOT / "configs" / name)
    check_launch(cfg)
    check_gpu_devices(cfg, device_count=0)
    assert gpu_claims(cfg) == {}


def test_existing_devices_pass_and_missing_ones_name_the_entry() -> None:
    cfg = _split()
    check_gpu_devices(cfg, device_count=2)
    check_gpu_devices(cfg, device_count=8)
    with pytest.raises(ConfigError, match=r"^placement\[2\] \(trainer\) asks for GPU 1, .* node 0 has only GPU 0$"):
        check_gpu_devices(cfg, device_count=1)
    with pytest.raises(ConfigError, match=r"placement\[1\] \(rollout\) asks for GPU 0 but node 0 has no GPU"):
        check_gpu_devices(cfg, device_count=0)
    wide = _cfg(PlacementEntry(role="rollout", devices=[0, 5]), PlacementEntry(role="trainer", devices=[1]))
    with pytest.raises(ConfigError, match=r"placement\[1\] \(rollout\) asks for GPU 5, .* has only GPUs 0-3"):
        check_gpu_devices(wide, device_count=4)


def test_roles_on_the_cpu_are_not_checked() -> None:
    # trainer.device=cpu: its devices only set CUDA_VISIBLE_DEVICES, it needs no GPU.
    cfg = _cfg(PlacementEntry(role="rollout"), PlacementEntry(role="trainer", count=2, devices=[0, 1]), device="cpu")
    check_gpu_devices(cfg, device_count=0)
    assert gpu_claims(cfg) == {}
    with pytest.raises(ConfigError, match=r"placement\[2\] \(trainer\) .* \(set trainer\.device=cpu or remove"):
        check_gpu_devices(_cfg(PlacementEntry(role="rollout"), PlacementEntry(role="trainer", devices=[0])), 0)
    gpu_controller = _cfg(PlacementEntry(role="rollout"), PlacementEntry(role="trainer"))
    gpu_controller.placement[0] = PlacementEntry(role="controller", devices=[3])
    check_gpu_devices(gpu_controller, device_count=0)


def test_cuda_trainer_without_devices_needs_a_gpu() -> None:
    cfg = _cfg(PlacementEntry(role="rollout"), PlacementEntry(role="trainer"), device="cuda")
    with pytest.raises(ConfigError, match=r"placement\[2\] \(trainer\): trainer\.device=cuda but node 0 has no GPU"):
        check_gpu_devices(cfg, device_count=0)
    check_gpu_devices(cfg, device_count=1)
    auto = _cfg(PlacementEntry(role="rollout"), PlacementEntry(role="trainer"), device="auto")
    check_gpu_devices(auto, device_count=0)  # auto falls back to the CPU


def test_only_this_nodes_entries_are_checked() -> None:
    cfg = _cfg(
        PlacementEntry(role="rollout", devices=[0]),
        PlacementEntry(role="trainer", devices=[0]),
        PlacementEntry(role="rollout", node=1, devices=[7]),
        PlacementEntry(role="trainer", count=2, nodes=[1, 2], devices=[0, 1]),
    )
    check_gpu_devices(cfg, device_count=1, node=0)
    check_gpu_devices(cfg, device_count=8, node=1)
    check_gpu_devices(cfg, device_count=2, node=2)
    with pytest.raises(ConfigError, match=r"placement\[3\] \(rollout\) asks for GPU 7"):
        check_gpu_devices(cfg, device_count=2, node=1)


def test_memory_claims_per_gpu() -> None:
    cfg = _cfg(
        PlacementEntry(role="rollout", devices=[0, 1]),  # one TP=2 engine: 0.3 on each GPU
        PlacementEntry(role="trainer", count=2, devices=[1, 2]),
        PlacementEntry(role="critic", count=1, devices=[2]),
        util=0.3,
        advantage="gae",
    )
    totals = {gpu: round(sum(c.fraction for c in claims), 6) for gpu, claims in gpu_claims(cfg).items()}
    assert totals == {(0, 0): 0.3, (0, 1): 0.5, (0, 2): 0.4}
    assert [c.entry for c in gpu_claims(cfg)[(0, 2)]] == ["placement[2] (trainer)", "placement[3] (critic)"]
    check_launch(cfg)


def test_rollout_and_trainer_sharing_a_gpu_must_leave_the_trainer_a_fifth() -> None:
    shared = (PlacementEntry(role="rollout", devices=[0]), PlacementEntry(role="trainer", devices=[0]))
    check_gpu_memory(_cfg(*shared, util=0.8))
    with pytest.raises(ConfigError) as err:
        check_gpu_memory(_cfg(*shared, util=0.85))
    assert str(err.value) == (
        "GPU 0 of node 0 is over-committed: placement[1] (rollout) 0.85 + placement[2] (trainer) 0.2 = 1.05 > 1.0; "
        "lower rollout.engine.gpu_memory_utilization to 0.8 or less (trainer/critic processes claim 0.2 each), "
        "or use other GPUs"
    )
    check_gpu_memory(_split(util=0.95))  # a GPU of its own: vLLM may take nearly all of it


def test_rollouts_sharing_a_gpu_and_crowded_trainers() -> None:
    two = PlacementEntry(role="rollout", count=2, devices=[0])  # both processes on GPU 0
    check_gpu_memory(_cfg(two, PlacementEntry(role="trainer", devices=[1]), util=0.5))
    with pytest.raises(ConfigError, match=r"= 1\.20 > 1\.0; lower rollout\.engine\.gpu_memory_utilization to 0\.5 "):
        check_gpu_memory(_cfg(two, PlacementEntry(role="trainer", devices=[1]), util=0.6))
    crowded = PlacementEntry(role="trainer", count=6, devices=[1])  # six ranks, one GPU
    with pytest.raises(ConfigError, match=r"GPU 1 of node 0 .* needs 0\.2 of a GPU: spread them over more GPUs"):
        check_gpu_memory(_cfg(PlacementEntry(role="rollout", devices=[0]), crowded))


def test_same_index_on_two_nodes_is_two_gpus() -> None:
    cfg = _cfg(
        PlacementEntry(role="rollout", devices=[0]),
        PlacementEntry(role="trainer", node=1, devices=[0]),
        util=0.9,
    )
    assert set(gpu_claims(cfg)) == {(0, 0), (1, 0)}
    check_launch(cfg)


def test_check_config_refuses_an_over_committed_gpu() -> None:
    cfg = _cfg(PlacementEntry(role="rollout", devices=[0]), PlacementEntry(role="trainer", devices=[0]), util=0.9)
    with pytest.raises(ConfigError, match="GPU 0 of node 0 is over-committed"):
        check_launch(cfg)


def test_bench_h200x2_recipe_loads_and_validates() -> None:
    cfg = load_config(ROOT / "configs" / "bench_h200x2.yaml", [])
    check_launch(cfg)
    t = cfg.model.tiny
    assert (t.hidden_size, t.num_layers, t.num_heads, t.num_kv_heads, t.intermediate_size) == (1536, 28, 12, 2, 8960)
    assert cfg.model.path == "" and cfg.data.source == "synthetic"
    assert cfg.rollout.ignore_eos and cfg.rollout.max_staleness == 2 and cfg.trainer.total_steps == 20
    assert (cfg.model.dtype, cfg.rollout.engine.dtype) == ("bfloat16", "bfloat16")
    assert cfg.fsdp.mixed_precision is not None and cfg.fsdp.mixed_precision.param_dtype == "bfloat16"
    devices = {e.role: e.devices for e in cfg.placement if e.devices}
    assert devices == {"rollout": [0], "trainer": [1]}
    check_gpu_devices(cfg, device_count=2)
    with pytest.raises(ConfigError, match=r"placement\[1\] \(rollout\) asks for GPU 0 but node 0 has no GPU"):
        check_gpu_devices(cfg, device_count=0)


def test_nccl_weight_sync_refuses_a_rollout_on_trainer_rank0s_gpu() -> None:
    colocated = (
        "placement=[{role: controller}, {role: reward}, {role: rollout, devices: [0]},"
        " {role: trainer, count: 2, devices: [0, 1]}]"
    )
    with pytest.raises(ConfigError, match="NCCL cannot hold two ranks on one GPU"):
        check_launch(load_config("configs/tiny_cpu.yaml", [colocated, "weight_sync.backend=nccl"]))
    check_launch(load_config("configs/tiny_cpu.yaml", [colocated, "weight_sync.backend=zmq"]))
    split = (
        "placement=[{role: controller}, {role: reward}, {role: rollout, devices: [0]},"
        " {role: trainer, count: 1, devices: [1]}]"
    )
    check_launch(load_config("configs/tiny_cpu.yaml", [split, "weight_sync.backend=nccl"]))


COLOCATED = (
    "placement=[{role: controller}, {role: reward}, {role: rollout, devices: [0]},"
    " {role: trainer, count: 1, devices: [0]}]"
)
SPLIT = (
    "placement=[{role: controller}, {role: reward}, {role: rollout, devices: [0]},"
    " {role: trainer, count: 1, devices: [1]}]"
)


def test_ipc_weight_sync_refuses_separate_gpus_and_a_cpu_trainer() -> None:
    check_launch(load_config("configs/tiny_cpu.yaml", [COLOCATED, "weight_sync.backend=ipc"]))
    with pytest.raises(ConfigError, match=r"weight_sync.backend=ipc: placement\[2\] \(rollout\) is on GPU \[0\]"):
        check_launch(load_config("configs/tiny_cpu.yaml", [SPLIT, "weight_sync.backend=ipc"]))
    with pytest.raises(ConfigError, match=r"ipc needs trainer\.device=cuda or auto"):
        check_launch(load_config("configs/tiny_cpu.yaml", ["weight_sync.backend=ipc", "trainer.device=cpu"]))


def test_which_rollouts_share_a_trainer_gpu() -> None:
    from runtime.config.placement import rollout_shares_trainer_gpu

    assert rollout_shares_trainer_gpu(load_config("configs/tiny_cpu.yaml", [COLOCATED]), 0)
    assert not rollout_shares_trainer_gpu(load_config("configs/tiny_cpu.yaml", [SPLIT]), 0)
    assert not rollout_shares_trainer_gpu(load_config("configs/tiny_cpu.yaml", []), 0)  # no devices: unknown
    two = (
        "placement=[{role: controller}, {role: reward}, {role: rollout, count: 2, devices: [0, 1]},"
        " {role: trainer, count: 1, devices: [1]}]"
    )
    cfg = load_config("configs/tiny_cpu.yaml", [two])
    assert [rollout_shares_trainer_gpu(cfg, r) for r in (0, 1)] == [False, True]
