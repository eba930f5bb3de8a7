"""CUDA IPC handles for the `ipc` weight-sync backend: a buffer on the trainer's GPU shared
with the vLLM worker on the same GPU, with no copy.

`share(flat)` describes a CUDA buffer as a `wire.IpcHandle` (plain bytes and numbers, so
it travels over our wire and vLLM's RPC without pickle); `open_shared(handle)` maps it in
another process as a uint8 tensor on the local device with that GPU's UUID, or raises
`IpcError` when this process sees no such GPU. The mapping lasts while the returned tensor
(or a view of it) lives; the sharing process must keep the buffer alive, unchanged, until
the reader is done (the sender reuses a buffer only after the bucket in it was
acknowledged).
"""

from __future__ import annotations

import torch

from runtime.errors import TandemError
from transport.wire import IpcHandle


class IpcError(TandemError, RuntimeError):
    """A handle that cannot be opened here (another GPU, or no GPU)."""


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID ("GPU-..."), the same in every process whatever CUDA_VISIBLE_DEVICES says."""
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


def share(flat: torch.Tensor) -> IpcHandle:
    from torch.multiprocessing.reductions import reduce_tensor

    if flat.device.type != "cuda" or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"ipc shares flat uint8 CUDA buffers, not {flat.dtype} {list(flat.shape)} on {flat.device}")
    _, args = reduce_tensor(flat)
    (
        _,
        size,
        _,
        tensor_offset,
        _,
        _,
        _,
        handle,
        storage_bytes,
        storage_offset,
        _,
        rc_handle,
        rc_offset,
        event,
        sync,
    ) = args
    return IpcHandle(
        device_uuid=device_uuid(flat.device),
        handle=handle,
        storage_bytes=storage_bytes,
        storage_offset=storage_offset,
        tensor_offset=tensor_offset,
        numel=int(size[0]),
        ref_counter=rc_handle,
        ref_counter_offset=rc_offset,
        event=event or b"",
        event_sync=bool(sync),
    )


def local_device(uuid: str) -> int:
    """The index of the visible GPU with `uuid`."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", i)) == uuid:
            return i
    seen = [device_uuid(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
    raise IpcError(f"ipc needs the trainer and the rollout on the same GPU: the trainer's {uuid} is not here ({seen})")


def open_shared(h: IpcHandle) -> torch.Tensor:
    """The shared buffer `h` describes, as a uint8 tensor on this process's view of its GPU."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = local_device(h.device_uuid)
    return rebuild_cuda_tensor(  # type: ignore[no-any-return]
        torch.Tensor,
        (h.numel,),
        (1,),
        h.tensor_offset,
        torch.storage.TypedStorage,
        torch.uint8,
        index,
        h.handle,
        h.storage_bytes,
        h.storage_offset,
        False,
        h.ref_counter,
        h.ref_counter_offset,
        h.event or None,
        h.event_sync,
    )
