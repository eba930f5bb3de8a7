"""`weight_sync.backend=auto` picks the backend each placement needs, and an explicit
`ipc` that cannot work is refused with one line naming the rollout and the GPUs."""

from __future__ import annotations

import pytest
import torch

from roles.weights.backend import BackendError, choose_backend
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
