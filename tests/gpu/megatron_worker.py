"""One rank of the Megatron GPU tests, run by tests/gpu/test_megatron.py under torchrun:

    python -m torch.distributed.run --nproc_per_node 2 -m tests.gpu.megatron_worker CASE MODEL_DIR OUT_DIR [ARGS]

* `logprobs TP PP DTYPE`: the Megatron engine's token logprobs against transformers' (fp32)
  on the same HF weights and sequences;
* `resume save|load DISTRIBUTED_OPTIMIZER` (one rank, fp32): `save` trains 2 steps, saves a
  checkpoint, draws from every RNG stream, trains steps 3-4; `load` builds a fresh engine,
  loads that checkpoint, draws again and trains steps 3-4 (OUT_DIR/<phase>.json each);
* `ppo`: one PPO step with Megatron TP=2 and one with FSDP2 (2 ranks) from the same
  weights and batch: losses, gradient norms and the updated weights; the Megatron export is
  also written as an HF directory (OUT_DIR/hf) for the vLLM check.

The rank that holds the answer writes OUT_DIR/result.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from runtime.config import RunConfig
from runtime.memory.auto import load_settled
from transport.wire import TrainBatch

WORLD = 2
NUM_SEQS = 12


def config(model_dir: str, *overrides: str) -> RunConfig:
    return load_settled(
        "configs/tiny_cpu.yaml",
        [f"model.path={model_dir}", "trainer.device=cuda", "fsdp.use_fsdp=false", "trainer.optim.lr=1e-4",
         "trainer.optim.warmup_steps=0", "trainer.micro_batch_tokens=256", *overrides],
    )  # fmt: skip


def full_batch(vocab: int, seed: int = 7) -> TrainBatch:
    """The same random batch on every rank: NUM_SEQS sequences of 20-90 tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 90, (NUM_SEQS,), generator=g)
    n = int(lengths.sum())
    cu = torch.zeros(NUM_SEQS + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    mask = torch.zeros(n)
    for i in range(NUM_SEQS):
        mask[int(cu[i]) + 8 : int(cu[i + 1])] = 1.0  # 8 prompt tokens, the rest is the response
    return TrainBatch(
        step=0, input_ids=torch.randint(0, vocab, (n,), generator=g), cu_seqlens=cu, loss_mask=mask,
        behaviour_logprobs=-6.0 + 0.3 * torch.randn(n, generator=g), advantages=torch.randn(n, generator=g),
        global_num_tokens=int(mask.sum()), global_num_seqs=NUM_SEQS,
    )  # fmt: skip


def shard(batch: TrainBatch, rank: int, world: int) -> TrainBatch:
    """Sequences rank, rank + world, ... (the controller also deals whole sequences)."""
    cu = batch.cu_seqlens.tolist()
    spans = [(cu[i], cu[i + 1]) for i in range(rank, len(cu) - 1, world)]
    idx = torch.cat([torch.arange(a, b) for a, b in spans])
    lengths = torch.tensor([b - a for a, b in spans])
    new_cu = torch.zeros(len(spans) + 1, dtype=torch.int64)
    new_cu[1:] = lengths.cumsum(0)
    return TrainBatch(
        step=0, input_ids=batch.input_ids[idx], cu_seqlens=new_cu, loss_mask=batch.loss_mask[idx],
        behaviour_logprobs=batch.behaviour_logprobs[idx], advantages=batch.advantages[idx],
        global_num_tokens=batch.global_num_tokens, global_num_seqs=batch.global_num_seqs,
    )  # fmt: skip


def hf_logprobs(model_dir: str, sequences: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    from roles.algo import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").to(device)
    out = []
    with torch.no_grad():
        for ids in sequences:
            ids = ids.to(device).unsqueeze(0)
            out.append(token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])[0].cpu())
    return out


def case_logprobs(model_dir: str, out: Path, tp: int, pp: int, dtype: str) -> None:
    from roles.megatron.engine_base import gather_shards
    from roles.trainer.megatron_engine import MegatronEngine

    m = "trainer.megatron."
    overrides = (
        f"{m}tensor_model_parallel_size={tp}",
        f"{m}pipeline_model_parallel_size={pp}",
        f"{m}params_dtype={dtype}",
    )
    cfg = config(model_dir, "trainer.backend=megatron", *overrides)
    engine = MegatronEngine(cfg, Path(model_dir))
    rank = dist.get_rank()
    batch = shard(full_batch(256), rank, WORLD)
    replica = gather_shards(batch, engine.replica_group, engine.device)  # a collective: every rank
    got = engine.forward_logprobs(batch)
    if got is None:
        return
    cu = replica.cu_seqlens.tolist()
    sequences = [replica.input_ids[cu[i] : cu[i + 1]] for i in range(len(cu) - 1)]
    want = hf_logprobs(model_dir, sequences, engine.device)
    diffs = torch.cat([(g - w).abs() for g, w in zip(got, want, strict=True)])
    result = {"case": "logprobs", "tp": tp, "pp": pp, "dtype": dtype, "sequences": len(got),
              "tokens": int(diffs.numel()), "max_abs_diff": float(diffs.max()), "mean_abs_diff": float(diffs.mean()),
              "lengths_match": all(g.shape == w.shape for g, w in zip(got, want, strict=True))}  # fmt: skip
    (out / "result.json").write_text(json.dumps(result))


def case_ppo(model_dir: str, out: Path) -> None:
    from roles.trainer.fsdp_engine import FSDPEngine
    from roles.trainer.megatron_engine import MegatronEngine
    from roles.training.hf_export import export_hf

    fsdp_cfg = config(model_dir, "fsdp.use_fsdp=true", "fsdp.param_dtype=float32")
    fsdp = FSDPEngine(fsdp_cfg, Path(model_dir))
    rank = dist.get_rank()
    batch = shard(full_batch(256), rank, WORLD)
    before = {k: v.float() for k, v in fsdp.export_weights(torch.float32)}
    fsdp_metrics = fsdp.train_step(batch)
    fsdp_after = {k: v.float() for k, v in fsdp.export_weights(torch.float32)}
    del fsdp
    mg_cfg = config(model_dir, "trainer.backend=megatron", "trainer.megatron.tensor_model_parallel_size=2",
                    "trainer.megatron.params_dtype=float32")  # fmt: skip
    mg = MegatronEngine(mg_cfg, Path(model_dir))
    mg_metrics = mg.train_step(batch)
    mg_after = dict(mg.export_weights(torch.float32))
    export_hf(mg.export_weights(torch.bfloat16), rank, Path(model_dir), out / "hf")
    if rank != 0:
        return
    per_tensor = {}
    for name, w0 in before.items():
        if name == "lm_head.weight" and name not in mg_after:
            continue  # tied: the FSDP state dict lists the embedding twice
        d_fsdp, d_mg = fsdp_after[name] - w0, mg_after[name] - w0
        per_tensor[name] = float((d_mg - d_fsdp).abs().mean() / d_fsdp.abs().mean().clamp(min=1e-12))
    result = {
        "case": "ppo", "fsdp": {k: fsdp_metrics[k] for k in ("loss", "grad_norm", "clip_fraction", "entropy")},
        "megatron": {k: mg_metrics[k] for k in ("loss", "grad_norm", "clip_fraction", "entropy")},
        "update_rel_diff_max": max(per_tensor.values()), "update_rel_diff": per_tensor,
        "exported": sorted(mg_after), "fsdp_names": sorted(fsdp_after),
    }  # fmt: skip
    (out / "result.json").write_text(json.dumps(result))


def rng_draws(device: torch.device) -> dict[str, list[float]]:
    """One draw from each stream a checkpoint restores: torch CPU, CUDA, megatron's TP tracker."""
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracker = torch.rand(3, device=device).tolist()
    return {"cpu": torch.rand(3).tolist(), "cuda": torch.rand(3, device=device).tolist(), "tracker": tracker}


def case_resume(model_dir: str, out: Path, phase: str, distributed: str) -> None:
    from roles.trainer.megatron_engine import MegatronEngine

    cfg = config(
        model_dir, "trainer.backend=megatron", "trainer.megatron.params_dtype=float32",
        f"trainer.megatron.use_distributed_optimizer={distributed}", "trainer.optim.warmup_steps=3",
    )  # fmt: skip
    engine = MegatronEngine(cfg, Path(model_dir))
    world = dist.get_world_size()

    def step(i: int) -> dict[str, float]:
        m = engine.train_step(shard(full_batch(256, seed=100 + i), dist.get_rank(), world))
        return {k: m[k] for k in ("loss", "grad_norm", "lr", "entropy")}

    result: dict = {"phase": phase, "steps": {}}
    if phase == "save":
        for i in (1, 2):
            step(i)
        engine.save(out / "ckpt")
    else:
        engine.load(out / "ckpt")
    result.update(version=engine.version, optimizer_steps=engine.optimizer_steps, rng=rng_draws(engine.device))
    for i in (3, 4):
        result["steps"][i] = step(i)
    result["weight_sum"] = float(sum(t.double().sum() for _, t in engine.export_weights(torch.float32)))
    if dist.get_rank() == 0:
        (out / f"{phase}.json").write_text(json.dumps(result))


def main() -> None:
    import faulthandler
    import os

    # A hung collective shows up as every thread's stack instead of a silent timeout.
    faulthandler.dump_traceback_later(float(os.environ.get("TANDEM_STACKS_AFTER_S", "150")), exit=True)
    case, model_dir, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    if case == "logprobs":
        case_logprobs(model_dir, out, int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    elif case == "resume":
        case_resume(model_dir, out, sys.argv[4], sys.argv[5])
    elif case == "ppo":
        case_ppo(model_dir, out)
    else:
        raise SystemExit(f"unknown case {case!r}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
