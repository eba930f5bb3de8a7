"""One rank of tests/gpu/test_megatron_moe_gpu.py: the Megatron engine on a tiny Qwen3-MoE,
one GPU, fp32, run under torchrun:

    python -m torch.distributed.run --nproc_per_node 1 -m tests.gpu.megatron_moe_worker MODEL_DIR OUT_DIR

Writes OUT_DIR/result.json with

* `logprob_max_abs_diff`: the engine's token logprobs against transformers' on the same
  weights and sequences;
* `own`: a step with `routing_replay: measure` whose batch carries transformers' own routing
  (what vLLM reports when it agrees with transformers): its routing figures;
* `replayed`: two steps with `routing_replay: rollout` whose batches carry random experts:
  their routing figures, loss and gradient norm;
* `exported` / `expected`: the HF names of the export and of the model directory;
  `trained_logprob_max_abs_diff`: the trained export, loaded by transformers, against the
  engine's logprobs (the export is the engine's model).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from tests.gpu.megatron_worker import NUM_SEQS, config, full_batch, hf_logprobs
from transport.wire import TrainBatch

FIGURES = ("routed_tokens", "router_disagree", "routing_mismatch", "router_aux_loss", "loss", "grad_norm")


def hf_routing(model_dir: str, batch: TrainBatch, device: torch.device) -> torch.Tensor:
    """transformers' own top-k experts of every token of `batch`, [N, layers, k]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    k = model.config.num_experts_per_tok
    cu = batch.cu_seqlens.tolist()
    rows = []
    with torch.no_grad():
        for i in range(len(cu) - 1):
            ids = batch.input_ids[cu[i] : cu[i + 1]].to(device).unsqueeze(0)
            logits = model(input_ids=ids, output_router_logits=True).router_logits
            rows.append(torch.stack([torch.topk(g.float().softmax(-1), k, dim=-1).indices for g in logits], 1))
    return torch.cat(rows).cpu()


def with_routing(batch: TrainBatch, experts: torch.Tensor) -> TrainBatch:
    """`batch` carrying `experts` for every token but each sequence's last (no forward consumed it)."""
    mask = torch.ones(batch.input_ids.numel(), dtype=torch.uint8)
    mask[batch.cu_seqlens[1:] - 1] = 0
    return msgspec.structs.replace(batch, routed_experts=experts.to(torch.uint8), routed_mask=mask)


def figures(m: dict[str, float]) -> dict[str, float]:
    return {k: m[k] for k in FIGURES if k in m}


def main() -> None:
    from roles.trainer.megatron_engine import MegatronEngine
    from roles.training.hf_export import export_hf

    model_dir, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    overrides = ("trainer.backend=megatron", "trainer.megatron.params_dtype=float32",
                 "trainer.loss.router_aux_coef=0.001", "algorithm.routing_replay=measure")  # fmt: skip
    cfg = config(model_dir, *overrides)
    engine = MegatronEngine(cfg, Path(model_dir))
    batch = full_batch(256)
    cu = batch.cu_seqlens.tolist()
    sequences = [batch.input_ids[cu[i] : cu[i + 1]] for i in range(NUM_SEQS)]

    def logprob_diff() -> float:
        got = engine.forward_logprobs(batch) or []
        want = hf_logprobs(str(out / "hf") if (out / "hf").exists() else model_dir, sequences, engine.device)
        return float(max((g - w).abs().max() for g, w in zip(got, want, strict=True)))

    result: dict = {"logprob_max_abs_diff": logprob_diff()}
    own = hf_routing(model_dir, batch, engine.device)
    result["own"] = figures(engine.train_step(with_routing(batch, own)))
    engine.cfg = msgspec.structs.replace(
        cfg, algorithm=msgspec.structs.replace(cfg.algorithm, routing_replay="rollout")
    )
    g = torch.Generator().manual_seed(11)
    result["replayed"] = []
    for seed in (1, 2):
        b = full_batch(256, seed=seed)
        N, (L, k) = b.input_ids.numel(), own.shape[1:]
        random = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(N * L)]).view(N, L, k)
        result["replayed"].append(figures(engine.train_step(with_routing(b, random))))
    exported = dict(engine.export_weights(torch.float32))
    result["exported"] = sorted(exported)
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        result["expected"] = sorted(k for k in f.keys() if k != "lm_head.weight")  # noqa: SIM118
    export_hf(iter(exported.items()), dist.get_rank(), Path(model_dir), out / "hf")
    result["trained_logprob_max_abs_diff"] = logprob_diff()
    (out / "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
