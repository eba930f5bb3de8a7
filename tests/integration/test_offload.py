"""`trainer.offload.optimizer` on CPU: `StreamedAdamW` (host-resident moments, streamed in
chunks) gives exactly `torch.optim.AdamW`'s parameters and moments, alone and inside the
real FSDP2 actor on 2 gloo ranks, and its state survives a checkpoint round trip
(torch.distributed.checkpoint) bit for bit."""

from __future__ import annotations

import copy
import faulthandler
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from roles.fsdp.offload import StreamedAdamW, _chunks
from roles.trainer.fsdp_engine import FSDPEngine
from runtime.config.load import load_config
from runtime.tiny.model import make_tiny_model
from tests.helpers.one_rank import full_params, toy_batch
from tests.helpers.ports import rendezvous_file

HYPER = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BASE = ["trainer.device=cpu", "fsdp.param_dtype=float32", "trainer.optim.lr=0.05", "trainer.optim.grad_clip=0"]
OFFLOAD = ["trainer.offload.optimizer=true", "trainer.offload.chunk_mb=1"]  # 1 MiB: many chunks, split tensors


def test_chunks_cover_every_element_once_and_split_tensors() -> None:
    sizes = [5, 17, 3, 40]
    chunks = list(_chunks(sizes, 16))
    assert all(sum(b - a for _, a, b in c) <= 16 for c in chunks)
    covered = sorted((i, k) for c in chunks for i, a, b in c for k in range(a, b))
    assert covered == [(i, k) for i, n in enumerate(sizes) for k in range(n)]
    assert any(len({i for i, _, _ in c}) > 1 for c in chunks)  # small tensors share a chunk


def test_streamed_adamw_equals_adamw_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    shapes = [(300, 7), (11,), (64, 64), (1,)]
    ref = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    own = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    adamw = torch.optim.AdamW(ref, **HYPER)  # type: ignore[arg-type]
    streamed = StreamedAdamW(own, chunk_bytes=8 * 1000, **HYPER)  # 1000 elements a chunk
    for _ in range(4):
        grads = [torch.randn(s, generator=g) for s in shapes]
        for p, q, grad in zip(ref, own, grads, strict=True):
            p.grad, q.grad = grad.clone(), grad.clone()
        adamw.step()
        streamed.step()
    for p, q in zip(ref, own, strict=True):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(adamw.state[p][key], streamed.state[q][key]), key
    # The state dict has AdamW's layout: AdamW itself loads it and goes on identically.
    again = [torch.nn.Parameter(q.detach().clone()) for q in own]
    loaded = torch.optim.AdamW(again, **HYPER)  # type: ignore[arg-type]
    loaded.load_state_dict(copy.deepcopy(streamed.state_dict()))  # AdamW would share the tensors
    grads = [torch.randn(s, generator=g) for s in shapes]
    for p, q, grad in zip(own, again, grads, strict=True):
        p.grad, q.grad = grad.clone(), grad.clone()
    streamed.step()
    loaded.step()
    assert all(torch.equal(p, q) for p, q in zip(own, again, strict=True))


def test_streamed_adamw_refuses_what_it_does_not_stream() -> None:
    with pytest.raises(ValueError, match="plain AdamW only"):
        StreamedAdamW([torch.nn.Parameter(torch.zeros(2))], chunk_bytes=1024, amsgrad=True)


def _moments(engine: FSDPEngine) -> list[torch.Tensor]:
    """Every parameter's moments, gathered (a collective), in parameter order."""
    out = []
    for p in engine.model.parameters():
        state = engine.optimizer.state[p]
        out += [state[k].full_tensor().clone() for k in ("exp_avg", "exp_avg_sq")]
    return out


def worker(rank: int, rendezvous: str, model: str, out: str) -> None:
    # A native abort in a spawned rank (once, in a loaded fresh-clone suite: "malloc(): unaligned
    # tcache chunk detected", not reproduced in 24 runs since) shows only as a signal; this
    # prints the Python stack of the rank that died beside it.
    faulthandler.enable()
    os.environ.update(RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)

    path, ckpt = Path(model), Path(out) / "ckpt"
    plain = FSDPEngine(load_config(None, BASE), path)
    offload = FSDPEngine(load_config(None, [*BASE, *OFFLOAD]), path)
    assert isinstance(offload.optimizer, StreamedAdamW)
    batches = [toy_batch(seed=10 * step + rank) for step in range(2)]
    plain.train_step(batches[0])
    metrics = offload.train_step(batches[0])
    offload.save(ckpt)
    plain.train_step(batches[1])
    offload.train_step(batches[1])
    resumed = FSDPEngine(load_config(None, [*BASE, *OFFLOAD]), path)
    resumed.load(ckpt)
    on_host = all(
        t.to_local().device.type == "cpu" for s in resumed.optimizer.state.values() for k, t in s.items() if k != "step"
    )
    resumed.train_step(batches[1])
    result = {
        "params": [full_params(e) for e in (plain, offload, resumed)],
        "moments": [_moments(e) for e in (plain, offload, resumed)],
        "offload_s": metrics["optimizer_offload_s"], "moments_on_host_after_load": on_host,
    }  # fmt: skip
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("offload") / "tiny")


@pytest.mark.slow
def test_fsdp2_actor_with_streamed_optimizer_equals_adamw_and_resumes(model_dir: Path, tmp_path: Path) -> None:
    mp.spawn(worker, args=(rendezvous_file(tmp_path), str(model_dir), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        plain, offload, resumed = r["params"]
        assert plain.keys() == offload.keys() == resumed.keys()
        for name in plain:
            assert torch.equal(plain[name], offload[name]), name
            assert torch.equal(offload[name], resumed[name]), name
        for a, b, c in zip(*r["moments"], strict=True):
            assert torch.equal(a, b) and torch.equal(b, c)
        assert r["moments_on_host_after_load"]
        assert r["offload_s"] > 0


def test_moments_live_in_one_host_buffer_of_exactly_their_size() -> None:
    """One buffer, not one allocation per moment: on CUDA it is page-locked once, exactly its
    size (torch's pinned allocator would round each moment up to a power of two)."""
    shapes = [(300, 7), (11,), (64, 64)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = StreamedAdamW(params, chunk_bytes=8 * 1000, **HYPER)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    numel = sum(p.numel() for p in params)
    assert opt.host_bytes == 2 * 4 * numel
    moments = [opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
    storages = {m.untyped_storage().data_ptr() for m in moments}
    assert len(storages) == 1 and moments[0].untyped_storage().nbytes() == opt.host_bytes
    # A loaded state dict goes into that buffer too, and the step after it equals AdamW's.
    saved = copy.deepcopy(opt.state_dict())
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    adamw = torch.optim.AdamW(ref, **HYPER)  # type: ignore[arg-type]
    adamw.load_state_dict(copy.deepcopy(saved))
    again = [torch.nn.Parameter(p.detach().clone()) for p in params]
    loaded = StreamedAdamW(again, chunk_bytes=8 * 1000, **HYPER)
    loaded.load_state_dict(saved)
    assert {loaded.state[p][k].untyped_storage().data_ptr() for p in again for k in ("exp_avg", "exp_avg_sq")} == {
        loaded.state[again[0]]["exp_avg"].untyped_storage().data_ptr()
    }
    grads = [torch.randn_like(p) for p in params]
    for p, q, g in zip(ref, again, grads, strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    adamw.step()
    loaded.step()
    for p, q in zip(ref, again, strict=True):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(adamw.state[p][key], loaded.state[q][key]), key
