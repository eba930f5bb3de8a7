"""Placement: processes per node, per-role rank numbering, rendezvous env, devices, errors."""

from __future__ import annotations

import pytest

from runtime.config import PlacementEntry, RunConfig
from runtime.config.load import load_config
from runtime.config.placement import role_counts
from runtime.launch.placement import PlacementError, ProcSpec, check_devices, plan_processes


def _cfg(*placement: PlacementEntry, advantage: str = "grpo") -> RunConfig:
    cfg = load_config(None, [f"algorithm.advantage={advantage}"])
    cfg.placement = list(placement)
    return cfg


TWO_NODES = (
    PlacementEntry(role="controller"),
    PlacementEntry(role="rollout", count=2, devices=[0, 1]),
    PlacementEntry(role="reward"),
    PlacementEntry(role="trainer", count=2, devices=[2, 3]),
    PlacementEntry(role="rollout", node=1, devices=[3], env={"VLLM_X": "1"}),
    PlacementEntry(role="trainer", count=3, node=1, devices=[0, 1, 2]),
)


def _names(specs: list[ProcSpec]) -> list[str]:
    return [s.name for s in specs]


def test_default_placement() -> None:
    specs = plan_processes(load_config(None), master_port=29500)
    assert _names(specs) == ["controller-0", "rollout-0", "reward-0", "trainer-0", "trainer-1"]
    assert all(s.node == 0 and s.devices == [] for s in specs)
    assert all("CUDA_VISIBLE_DEVICES" not in s.env for s in specs)
    assert specs[0].env == {}  # only trainer ranks get the rendezvous variables
    assert role_counts(load_config(None)) == {"controller": 1, "rollout": 1, "reward": 1, "trainer": 2}


def test_trainer_rendezvous_env() -> None:
    specs = plan_processes(load_config(None), master_addr="10.1.2.3", master_port=29500)
    trainers = [s for s in specs if s.role == "trainer"]
    assert [s.env for s in trainers] == [
        {
            "RANK": str(r),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(r),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.1.2.3",
            "MASTER_PORT": "29500",
        }
        for r in (0, 1)
    ]


def test_ranks_are_numbered_per_role_across_entries_and_nodes() -> None:
    node0 = plan_processes(_cfg(*TWO_NODES), 0, master_addr="head", master_port=4000)
    node1 = plan_processes(_cfg(*TWO_NODES), 1, master_addr="head", master_port=4000)
    assert _names(node0) == ["controller-0", "rollout-0", "rollout-1", "reward-0", "trainer-0", "trainer-1"]
    assert _names(node1) == ["rollout-2", "trainer-2", "trainer-3", "trainer-4"]
    assert {s.node for s in node1} == {1}
    assert plan_processes(_cfg(*TWO_NODES), 2) == []


def test_multi_node_trainer_env_has_global_ranks_and_local_ranks() -> None:
    specs = plan_processes(_cfg(*TWO_NODES), 1, master_addr="head", master_port=4000)
    trainers = [s for s in specs if s.role == "trainer"]
    assert [(s.env["RANK"], s.env["LOCAL_RANK"]) for s in trainers] == [("2", "0"), ("3", "1"), ("4", "2")]
    assert {
        (s.env["WORLD_SIZE"], s.env["LOCAL_WORLD_SIZE"], s.env["MASTER_ADDR"], s.env["MASTER_PORT"]) for s in trainers
    } == {("5", "3", "head", "4000")}
    node0 = [s for s in plan_processes(_cfg(*TWO_NODES), 0, master_port=4000) if s.role == "trainer"]
    assert [(s.env["RANK"], s.env["LOCAL_RANK"], s.env["LOCAL_WORLD_SIZE"]) for s in node0] == [
        ("0", "0", "2"),
        ("1", "1", "2"),
    ]


def test_cuda_visible_devices_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    node0 = {s.name: s for s in plan_processes(_cfg(*TWO_NODES), 0)}
    node1 = {s.name: s for s in plan_processes(_cfg(*TWO_NODES), 1)}
    assert node0["rollout-0"].env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert node0["rollout-1"].env == {"CUDA_VISIBLE_DEVICES": "1"}
    assert node0["trainer-1"].devices == [3] and node0["trainer-1"].env["CUDA_VISIBLE_DEVICES"] == "3"
    assert "CUDA_VISIBLE_DEVICES" not in node0["controller-0"].env
    assert node1["rollout-2"].env == {"VLLM_X": "1", "CUDA_VISIBLE_DEVICES": "3"}
    assert [node1[f"trainer-{r}"].env["CUDA_VISIBLE_DEVICES"] for r in (2, 3, 4)] == ["0", "1", "2"]


def test_devices_count_the_gpus_the_launcher_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under CUDA_VISIBLE_DEVICES=5,GPU-abc,2, index 1 is the launcher's second visible GPU:
    a launch confined to some GPUs of a shared machine never reaches the others."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5, GPU-abc,2")
    cfg = _cfg(
        PlacementEntry(role="controller"),
        PlacementEntry(role="rollout", devices=[1, 2]),
        PlacementEntry(role="trainer", count=2, devices=[0, 1]),
    )
    specs = {s.name: s for s in plan_processes(cfg)}
    assert specs["rollout-0"].env["CUDA_VISIBLE_DEVICES"] == "GPU-abc,2"
    assert [specs[f"trainer-{r}"].env["CUDA_VISIBLE_DEVICES"] for r in (0, 1)] == ["5", "GPU-abc"]
    assert specs["trainer-1"].devices == [1]  # the index, checked against the visible count
    assert "CUDA_VISIBLE_DEVICES" not in specs["controller-0"].env  # inherits the launcher's


def test_one_process_may_take_several_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = _cfg(
        PlacementEntry(role="controller"),
        PlacementEntry(role="rollout", devices=[0, 1]),
        PlacementEntry(role="trainer", devices=[2]),
    )
    specs = {s.name: s for s in plan_processes(cfg)}
    assert specs["rollout-0"].env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_trainer_ranks_need_one_device_each() -> None:
    cfg = _cfg(
        PlacementEntry(role="controller"),
        PlacementEntry(role="rollout"),
        PlacementEntry(role="trainer", count=3, devices=[0, 1]),
    )
    with pytest.raises(PlacementError, match="trainer: 3 processes but 2 devices"):
        plan_processes(cfg)


@pytest.mark.parametrize(
    ("placement", "message"),
    [
        ((PlacementEntry(role="rollout"), PlacementEntry(role="trainer")), "exactly one controller, has 0"),
        (
            (
                PlacementEntry(role="controller"),
                PlacementEntry(role="controller", node=1),
                PlacementEntry(role="rollout"),
                PlacementEntry(role="trainer"),
            ),
            "exactly one controller, has 2",
        ),
        ((PlacementEntry(role="controller"), PlacementEntry(role="trainer")), "at least one rollout"),
        (
            (
                PlacementEntry(role="controller"),
                PlacementEntry(role="rollout", count=0),
                PlacementEntry(role="trainer"),
            ),
            "at least one rollout",
        ),
        ((PlacementEntry(role="controller"), PlacementEntry(role="rollout")), "at least one trainer"),
    ],
)
def test_impossible_placements(placement: tuple[PlacementEntry, ...], message: str) -> None:
    with pytest.raises(PlacementError, match=message):
        plan_processes(_cfg(*placement))


def test_gae_adds_a_critic_or_refuses_a_zero_count_one() -> None:
    base = (PlacementEntry(role="controller"), PlacementEntry(role="rollout"), PlacementEntry(role="trainer"))
    specs = plan_processes(_cfg(*base, advantage="gae"), master_port=4000)
    critic = next(s for s in specs if s.role == "critic")
    assert critic.env["MASTER_PORT"] == "4001"  # its own process group, beside the trainer's
    assert (critic.env["RANK"], critic.env["WORLD_SIZE"]) == ("0", "1")
    with pytest.raises(PlacementError, match="gae needs a critic"):
        plan_processes(_cfg(*base, PlacementEntry(role="critic", count=0), advantage="gae"))


def test_check_devices_names_the_process() -> None:
    cfg = _cfg(
        PlacementEntry(role="controller"),
        PlacementEntry(role="rollout", devices=[0]),
        PlacementEntry(role="trainer", count=2, devices=[1, 3]),
    )
    specs = plan_processes(cfg)
    with pytest.raises(PlacementError, match=r"trainer-1: GPU 3 does not exist \(this node has 2\)"):
        check_devices(specs, num_gpus=2)
    check_devices(specs, num_gpus=4)
    check_devices(plan_processes(load_config(None)), num_gpus=0)  # no devices asked, none needed
