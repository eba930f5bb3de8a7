"""`weight_sync.backend=auto` picks the backend each placement needs, an explicit `ipc` or
`nccl` that cannot work is refused with one line naming the rollout and the GPUs, and
`make_transfer` builds the chosen backend's transfer."""

from __future__ import annotations

import pytest
import torch

from roles.weights.backend import BackendError, choose_backend, make_transfer
from roles.weights.transfers import IpcTransfer, NcclTransfer, ZmqTransfer
from transport.wire import PeerInfo

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")
MINE, OTHER = "GPU-aaaa", "GPU-bbbb"


def rollout(rank: int, gpu: str) -> PeerInfo:
    return PeerInfo(role="rollout", rank=rank, capabilities={"gpu_uuid": gpu})


@pytest.mark.parametrize(
    ("device", "gpus", "expected"),
    [
        (CUDA, [MINE], "ipc"),  # colocated on trainer rank 0's GPU
        (CUDA, [MINE, MINE], "ipc"),
        (CUDA, [OTHER], "nccl"),  # both on CUDA, separate GPUs
        (CUDA, [MINE, OTHER], "nccl"),
        (CUDA, [""], "zmq"),  # a rollout on the CPU
        (CPU, [""], "zmq"),  # everything on the CPU
        (CPU, [OTHER], "zmq"),  # a CPU trainer cannot broadcast from a GPU
        (CUDA, [], "zmq"),
    ],
)
def test_auto_picks_by_placement(device: torch.device, gpus: list[str], expected: str) -> None:
    uuid = MINE if device.type == "cuda" else ""
    assert choose_backend("auto", device, uuid, [rollout(i, g) for i, g in enumerate(gpus)]) == expected


def test_explicit_backends_are_taken_as_given() -> None:
    assert choose_backend("zmq", CUDA, MINE, [rollout(0, MINE)]) == "zmq"
    assert choose_backend("nccl", CPU, "", [rollout(0, "")]) == "nccl"  # gloo from a CPU trainer


def test_ipc_is_refused_off_trainer_rank0s_gpu_in_one_line() -> None:
    with pytest.raises(BackendError) as err:
        choose_backend("ipc", CUDA, MINE, [rollout(0, MINE), rollout(1, OTHER)])
    text = str(err.value)
    assert "\n" not in text and "rollout-1 on GPU-bbbb" in text and MINE in text
    with pytest.raises(BackendError, match="needs trainer rank 0 on a GPU"):
        choose_backend("ipc", CPU, "", [rollout(0, "")])


def test_nccl_to_a_rollout_on_trainer_rank0s_own_gpu_is_refused_at_run_time() -> None:
    """The config check refuses a colocated nccl placement it can see; a rollout whose GPU is
    only known when it registers (no `devices` in placement) is refused here, naming it."""
    with pytest.raises(BackendError) as err:
        choose_backend("nccl", CUDA, MINE, [rollout(0, OTHER), rollout(1, MINE)])
    text = str(err.value)
    assert "\n" not in text and "rollout-1" in text and "rollout-0" not in text and "use ipc" in text
    assert choose_backend("nccl", CUDA, MINE, [rollout(0, OTHER)]) == "nccl"


@pytest.mark.parametrize(("backend", "kind"), [("ipc", IpcTransfer), ("nccl", NcclTransfer), ("zmq", ZmqTransfer)])
def test_make_transfer_builds_the_chosen_backend(backend: str, kind: type) -> None:
    transfer = make_transfer(backend, timeout_s=5.0, token="t", device=CPU, host="127.0.0.1", workers_per_rollout=2)
    assert isinstance(transfer, kind) and transfer.name == backend
    if isinstance(transfer, NcclTransfer):
        assert transfer.world_size == 3 and transfer.backend == "gloo"  # a CPU trainer broadcasts over gloo
    with pytest.raises(BackendError, match="no transfer for weight-sync backend 'auto'"):
        make_transfer("auto", timeout_s=5.0, token="t", device=CPU, host="", workers_per_rollout=1)
