"""Host-memory offload for the FSDP2 actor (`trainer.offload`, docs/memory.md).

`StreamedAdamW` is `torch.optim.AdamW` whose two moment tensors live in host memory
(pinned when the parameters are on CUDA). Its `step` streams them through the GPU in
chunks of at most `chunk_bytes` of state: chunk k+1 is copied in while chunk k is
updated and chunk k-1 is copied back, on two copy streams beside the compute stream, in
two GPU slots that exist only during the step. What a caller may rely on:

* after `step()` the parameters and moments equal those `torch.optim.AdamW` gives for the
  same gradients (the update is elementwise; it is run on slices of the flattened local
  shards, with foreach kernels on CUDA and the single-tensor path on CPU, as AdamW picks);
* the moments are back in host memory when `step` returns;
* all moments sit in one host buffer of exactly their size (`host_bytes`), page-locked
  once with cudaHostRegister when the parameters are on CUDA. Not `pin_memory=True`:
  torch's pinned allocator rounds every allocation up to a power of two (measured on
  torch 2.11: 8 tensors of 271.6 MB cost 4.39 GB instead of 2.17), so a 7B actor's 61 GB
  of moments took ~116 GB of host memory and the trainer was killed by the OOM killer;
* the state dict has AdamW's layout (moments as DTensors for DTensor parameters), so
  torch.distributed.checkpoint saves and loads it as it does AdamW's; `load_state_dict`
  puts the moments back into host memory.

`ParamOffload` moves an FSDP2 model's parameters (their local shards) to host memory and
back (`module.to`, which FSDP2 applies to its sharded parameters in place, so optimizer
state keyed by parameter stays valid): the actor does it between a weight update and the
next step of a synchronous colocated run, where vLLM needs that memory meanwhile.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.optim.adamw import adamw as adamw_update

MOMENTS = ("exp_avg", "exp_avg_sq")
_Slice = tuple[int, int, int]  # (parameter index in the group, start, end) of the flattened shard


class StreamedAdamW(torch.optim.AdamW):
    """AdamW with host-resident moments, streamed through the device at each step."""

    def __init__(self, params: Iterable[Any], *, chunk_bytes: int, **adamw: Any) -> None:
        super().__init__(params, **adamw)
        if any(self.defaults.get(k) for k in ("amsgrad", "maximize", "fused", "capturable", "differentiable")):
            raise ValueError("StreamedAdamW supports plain AdamW only (no amsgrad, maximize, fused, capturable)")
        self.chunk_elems = max(1, chunk_bytes // (len(MOMENTS) * 4))
        self._streams: tuple[Any, Any] | None = None
        self.last_step_s = 0.0
        self._slots: dict[Any, tuple[torch.Tensor, ...]] | None = None  # parameter -> its moments' buffers
        self.host_bytes = 0  # the moments' host buffer (0 until the first step or load)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        started = time.perf_counter()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group(group, params)
        self.last_step_s = time.perf_counter() - started
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """AdamW's `load_state_dict`, the moments copied straight into the host buffer
        (AdamW's own would first cast them to each parameter's device: for a 7B actor on
        one GPU, 61 GB of GPU memory that is not there)."""
        moments: dict[Any, dict[str, torch.Tensor]] = {}
        rest: dict[Any, dict[str, Any]] = {}
        for pid, st in state_dict["state"].items():
            moments[pid] = {k: v for k, v in st.items() if k in MOMENTS}
            rest[pid] = {k: v for k, v in st.items() if k not in MOMENTS}
        super().load_state_dict({**state_dict, "state": rest})
        slots = self._host_slots()
        ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params, strict=True):  # AdamW's own pairing of saved and current
            for key, slot in zip(MOMENTS, slots[p], strict=True):
                if key in moments.get(pid, {}):
                    self.state[p][key] = _place(slot, moments[pid][key], p)

    def _host_slots(self) -> dict[Any, tuple[torch.Tensor, ...]]:
        """Each trainable parameter's moment buffers (views of one host buffer, zeros when
        made), made at the first call for every parameter of every group."""
        if self._slots is None:
            params = [p for g in self.param_groups for p in g["params"]]
            sizes = [_local(p).numel() for p in params]
            arena = torch.zeros(len(MOMENTS) * sum(sizes), dtype=torch.float32)
            if params and _local(params[0]).is_cuda:
                _page_lock(arena)
                weakref.finalize(self, _page_unlock, arena)  # holds the buffer until then
            self.host_bytes = arena.numel() * arena.element_size()
            self._slots, offset = {}, 0
            for p, n in zip(params, sizes, strict=True):
                shape = _local(p).shape
                views = []
                for _ in MOMENTS:
                    views.append(arena[offset : offset + n].view(shape))
                    offset += n
                self._slots[p] = tuple(views)
        return self._slots

    # --- one parameter group ---------------------------------------------------------
    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        slots = self._host_slots()
        for p in params:
            if not self.state[p]:
                self.state[p]["step"] = torch.tensor(0.0, dtype=torch.float32)
                for key, slot in zip(MOMENTS, slots[p], strict=True):
                    self.state[p][key] = _place(slot, None, p)
        flat = [_flat(p) for p in params]
        grads = [_flat(p.grad) for p in params if p.grad is not None]
        moments = [[_flat(self.state[p][k]) for k in MOMENTS] for p in params]
        steps = [float(self.state[p]["step"]) for p in params]
        device = flat[0].device
        chunks = list(_chunks([t.numel() for t in flat], self.chunk_elems))
        run = self._run_cuda if device.type == "cuda" else self._run_host
        run(group, chunks, flat, grads, moments, steps, device)
        for p in params:
            self.state[p]["step"] += 1

    def _update(
        self,
        group: dict[str, Any],
        chunk: list[_Slice],
        flat: list[torch.Tensor],
        grads: list[torch.Tensor],
        slot: torch.Tensor,
        steps: list[float],
        foreach: bool,
    ) -> None:
        """AdamW on the chunk's slices, the moments in `slot` ([2, n], in chunk order)."""
        ps, gs, ms, vs, ss = [], [], [], [], []
        offset = 0
        for i, a, b in chunk:
            n = b - a
            ps.append(flat[i][a:b])
            gs.append(grads[i][a:b])
            ms.append(slot[0, offset : offset + n])
            vs.append(slot[1, offset : offset + n])
            ss.append(torch.tensor(steps[i], dtype=torch.float32))  # advanced by the update, then dropped
            offset += n
        beta1, beta2 = group["betas"]
        adamw_update(
            ps,
            gs,
            ms,
            vs,
            [],
            ss,
            foreach=foreach,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def _run_host(
        self,
        group: dict[str, Any],
        chunks: list[list[_Slice]],
        flat: list[torch.Tensor],
        grads: list[torch.Tensor],
        moments: list[list[torch.Tensor]],
        steps: list[float],
        device: torch.device,
    ) -> None:
        """The same chunked update without streams (parameters in host memory: CPU, gloo)."""
        slot = torch.empty(2, self.chunk_elems, dtype=torch.float32, device=device)
        for chunk in chunks:
            _copy_in(slot, chunk, moments, non_blocking=False)
            self._update(group, chunk, flat, grads, slot, steps, foreach=False)
            _copy_out(slot, chunk, moments, non_blocking=False)

    def _run_cuda(
        self,
        group: dict[str, Any],
        chunks: list[list[_Slice]],
        flat: list[torch.Tensor],
        grads: list[torch.Tensor],
        moments: list[list[torch.Tensor]],
        steps: list[float],
        device: torch.device,
    ) -> None:
        if self._streams is None:
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        h2d, d2h = self._streams
        compute = torch.cuda.current_stream(device)
        slots = [torch.empty(2, self.chunk_elems, dtype=torch.float32, device=device) for _ in range(2)]
        freed: list[torch.cuda.Event | None] = [None, None]
        h2d.wait_stream(compute)  # the slots were just allocated on the compute stream
        for k, chunk in enumerate(chunks):
            slot = slots[k % 2]
            with torch.cuda.stream(h2d):
                if (done := freed[k % 2]) is not None:
                    h2d.wait_event(done)  # its previous chunk is back in host memory
                _copy_in(slot, chunk, moments, non_blocking=True)
                loaded = h2d.record_event()
            compute.wait_event(loaded)
            self._update(group, chunk, flat, grads, slot, steps, foreach=True)
            updated = compute.record_event()
            with torch.cuda.stream(d2h):
                d2h.wait_event(updated)
                _copy_out(slot, chunk, moments, non_blocking=True)
                freed[k % 2] = d2h.record_event()
        d2h.synchronize()  # the host moments are final before step() returns
        compute.wait_stream(d2h)  # the slots are freed on the compute stream


def _chunks(sizes: list[int], limit: int) -> Iterable[list[_Slice]]:
    """Consecutive slices of the flattened tensors, at most `limit` elements per chunk."""
    chunk: list[_Slice] = []
    room = limit
    for i, n in enumerate(sizes):
        start = 0
        while start < n:
            take = min(room, n - start)
            chunk.append((i, start, start + take))
            start += take
            room -= take
            if room == 0:
                yield chunk
                chunk, room = [], limit
    if chunk:
        yield chunk


def _copy_in(slot: torch.Tensor, chunk: list[_Slice], moments: list[list[torch.Tensor]], *, non_blocking: bool) -> None:
    offset = 0
    for i, a, b in chunk:
        for j, host in enumerate(moments[i]):
            slot[j, offset : offset + b - a].copy_(host[a:b], non_blocking=non_blocking)
        offset += b - a


def _copy_out(
    slot: torch.Tensor, chunk: list[_Slice], moments: list[list[torch.Tensor]], *, non_blocking: bool
) -> None:
    offset = 0
    for i, a, b in chunk:
        for j, host in enumerate(moments[i]):
            host[a:b].copy_(slot[j, offset : offset + b - a], non_blocking=non_blocking)
        offset += b - a


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _flat(t: torch.Tensor) -> torch.Tensor:
    return _local(t).view(-1)


def _place(slot: torch.Tensor, t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """`slot` (a host buffer shaped like `like`'s local shard) holding `t` (None: zeros), a
    DTensor again if `like` is one."""
    if t is None:
        slot.zero_()
    else:
        slot.copy_(_local(t))
    if isinstance(like, DTensor):
        # Not `DTensor.from_local`: it moves a local tensor to the mesh's device type, which
        # put every moment back on the GPU (a 7B actor held 61 GB of them there).
        meta = TensorMeta(like.shape, like.stride(), slot.dtype)
        return DTensor(slot, DTensorSpec(like.device_mesh, like.placements, tensor_meta=meta), requires_grad=False)
    return slot


def _page_lock(t: torch.Tensor) -> None:
    """Page-lock `t`'s memory in place, exactly its size (copies to and from it can overlap)."""
    size = t.numel() * t.element_size()
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), size, 1)  # 1: portable, as torch's DCP stager pins
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {size / 1e9:.1f} GB of optimizer moments failed: error {int(err)}")


def _page_unlock(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class ParamOffload:
    """Moves an FSDP2 model's parameters to host memory and back; `offloaded` says where they are."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.offloaded = False
        self.last_s = 0.0

    def offload(self) -> None:
        if not self.offloaded:
            started = time.perf_counter()
            self.model.to("cpu")
            self.offloaded = True
            self.last_s = time.perf_counter() - started

    def restore(self) -> None:
        if self.offloaded:
            started = time.perf_counter()
            self.model.to(self.device)
            self.offloaded = False
            self.last_s = time.perf_counter() - started
