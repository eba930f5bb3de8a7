"""The FSDP2 actor engine's `train_step` against a bare padded FSDP2 loop, in one run. Prints JSON.

Both train the same model (the tiny-model maker in Qwen2.5-1.5B's shape with Qwen's
151,936-token vocabulary: 1.54B parameters) on the same token batches with the same loss
(`ppo_policy_loss`, token-mean, default `trainer.loss`), AdamW, bf16 compute / fp32 master
weights and reduction, no activation checkpointing:

* engine: `roles.trainer.fsdp_engine.FSDPEngine` as configured by default (packed
  micro-batches of `--engine-budget` real tokens, default 16384, with varlen attention,
  logprobs and entropy chunked from the last hidden state), plus any `--engine-option
  KEY=VALUE` (e.g. `trainer.compile=true`);
* bare: written plainly below: HF model with SDPA, `fully_shard` per block and root,
  micro-batches padded to their longest row (rows x longest <= `--budget`, default 16384,
  halved while a case runs out of memory, down to 2048; each case records the budget it
  ran with), in order, full fp32 logits, `log_softmax` gather, entropy of the full logits
  for the metric.

Cases: `fixed_1k` (1024-token sequences), `fixed_4k` (4096), `length_mix` (log-uniform
64..4096, an RL-like mix), each about `--tokens` tokens per step; every case runs
`--warmup` untimed steps, then `--steps` timed ones. Per case and loop: tokens/s,
`mfu` = (6 * N * tokens + attention FLOPs) / time / peak, N = every parameter (tied
embeddings once; the embedding lookup is no matmul, but the tied LM head is), attention
FLOPs = 6 * 2 * sum over sequences of len^2 / 2 * hidden * layers (forward QK^T and PV of
a causal mask, x3 for backward), counted on real tokens only, so padding earns nothing;
`mfu_6n` the same without the attention FLOPs (6 * N * tokens alone, the figure peers
quote); peak memory (`torch.cuda.max_memory_allocated`). Top-level keys: `mfu_4k` (the
engine's fixed_4k MFU), `mfu_6n_4k` and `mfu_6n_length_mix` (the engine's 6N MFU on those
cases), `speedup_length_mix` (engine tokens/s over the bare loop's on the mix),
`peak_gb` (the engine's largest peak), `loss_match` (both loops' first-step loss on the
same weights and batch agree to 2e-2).

`--memory-16k`: instead, one micro-batch of 16,384 tokens (4 x 4096), the engine with
chunked logprobs vs full logits (`trainer.logprob_chunk_tokens=0`), each without and with
activation recompute (`trainer.gradient_checkpointing`; the activations of 16k tokens
are the same in both and dilute the ratio): peak memory of the step and above what was
resident before it (weights, grads, optimizer state), and their ratios (the aim is
<= 0.5).

`--profile N`: after timing a case, one more engine step runs under torch.profiler; the
case's engine entry gains `profile`: the share of GPU time per kernel class (gemm,
attention, optimizer, copy/cast, other: elementwise and reductions), the N kernels with
the most GPU time and the N operators (with input shapes) whose own kernels took the most;
`--trace DIR` also writes each profiled step's Chrome trace there. `--loops engine` skips
the bare loop (no ratios then).

`--variant NAME KEY=VALUE...` (repeatable; needs the engine loop): after the loops, the engine
once more per variant with those options added, on the same cases and batches, then the base
engine again (`base_again`, with `drift`: its step time over the first run's, so the machine's
drift over the run shows beside the ratios). `variants.NAME.cases.CASE` holds the loop's
figures plus `speedup` (the mean of the base's two step times over the variant's) and
`last_loss_diff` (|the last timed step's loss - the base's|: the same updates from the same
weights on the same batch, so a variant that changes the sums shows here; FA2's backward is
not bit-deterministic, so on CUDA equal sums still differ in the last digits). Each entry
has every loop's keys, including `last_loss`; `--profile` profiles each variant as well. A
variant that fails to start or to step is recorded as `error` (one line) and the rest run.

`--engine-option trainer.kernels=liger` (roles/kernels/block_kernels.py) needs `--loops engine`: Liger
patches transformers' Qwen2 module for the whole process, so a bare loop after it would run
Liger's kernels too.

`--quick`: a tiny model on the CPU (gloo), seconds; what the unit test runs.

    python3 benchmarks/trainer.py --out benchmarks/results/trainer_h200x1.json
    python3 benchmarks/trainer.py --memory-16k --out benchmarks/results/trainer_h200x1_memory.json
    python3 benchmarks/trainer.py --quick --out /tmp/trainer_quick.json
    python3 benchmarks/trainer.py --cases fixed_4k --loops engine --profile 15 \
        --engine-option trainer.compile=true --out /tmp/trainer_compiled.json
    python3 benchmarks/trainer.py --cases fixed_4k --loops engine --engine-option trainer.compile=true \
        --variant reduced fsdp.one_rank_accumulation=reduced --out /tmp/trainer_accumulation.json
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from benchmarks.json_out import one_line_error, provenance
from roles.kernels.varlen import cuda_kernel
from runtime.memory.auto import load_settled
from runtime.tiny.model import make_tiny_model
from transport.wire import TrainBatch

H200_BF16_DENSE_TFLOPS = 989.0
QWEN25_15B = dict(
    hidden_size=1536,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    intermediate_size=8960,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    vocab_size=151936,
)
QUICK = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=128,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    vocab_size=1024,
)
PROMPT_TOKENS = 32


# --- batches and FLOPs (pure) -----------------------------------------------------------
def case_lengths(case: str, tokens: int, longest: int, seed: int = 0) -> list[int]:
    """Sequence lengths of a case, about `tokens` in all (`longest` scales the cases for --quick)."""
    if case == "fixed_1k":
        n = longest // 4
        return [n] * max(1, tokens // n)
    if case == "fixed_4k":
        return [longest] * max(1, tokens // longest)
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    low, high = math.log(longest / 64), math.log(longest)
    while sum(lengths) < tokens:
        lengths.append(int(math.exp(low + (high - low) * float(torch.rand(1, generator=g)))))
    return lengths


def make_batch(lengths: list[int], vocab: int, seed: int = 0) -> TrainBatch:
    """A training batch of random ids; the first PROMPT_TOKENS (at most half) of each are prompt."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    mask = torch.cat([(torch.arange(n) >= min(PROMPT_TOKENS, n // 2)).float() for n in lengths])
    adv = torch.cat([torch.full((n,), 1.0 if i % 2 else -1.0) for i, n in enumerate(lengths)]) * mask
    return TrainBatch(
        step=0,
        input_ids=torch.randint(0, vocab, (int(cu[-1]),), generator=g),
        cu_seqlens=cu,
        loss_mask=mask,
        behaviour_logprobs=torch.full((int(cu[-1]),), -8.0) * mask,
        advantages=adv,
        global_num_tokens=int(mask.sum()),
        global_num_seqs=len(lengths),
    )


def train_flops(lengths: list[int], num_params: int, hidden: int, layers: int, *, attention: bool = True) -> float:
    """6 N tokens + causal attention (forward 2 * len^2 * hidden per layer, x3 with backward);
    without `attention`, 6 N tokens alone."""
    tokens = sum(lengths)
    attn = 6.0 * sum(n * n for n in lengths) * hidden * layers if attention else 0.0
    return 6.0 * num_params * tokens + attn


# --- the two loops -------------------------------------------------------------------------
def engine_loop(model_dir: Path, overrides: list[str]) -> tuple[Any, Callable[[TrainBatch], float]]:
    from roles.trainer.fsdp_engine import FSDPEngine

    engine = FSDPEngine(load_settled(None, overrides), model_dir)
    return engine, lambda batch: float(engine.train_step(batch)["loss"])


def bare_loop(model_dir: Path, overrides: list[str], device: torch.device, budget: list[int]) -> tuple[Any, Callable]:
    """HF model, fully_shard, padded micro-batches (rows x longest <= budget[0], read at each
    step), full logits; the step returns the loss."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    from roles.algo import entropy_from_logits, ppo_policy_loss, token_logprobs
    from roles.trainer.policy_loss import policy_loss_options

    cfg = load_settled(None, overrides)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    torch.nn.Module.to(model, device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" else None
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp) if mp else fully_shard(layer)
    fully_shard(model, mp_policy=mp) if mp else fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    opts = policy_loss_options(cfg)
    norm_tokens = opts.pop("norm_tokens")

    def step(batch: TrainBatch) -> float:
        optimizer.zero_grad(set_to_none=True)  # nothing left over from a step that ran out of memory
        cu = batch.cu_seqlens.tolist()
        spans = list(itertools.pairwise(cu))
        total = 0.0
        for group in _padded_groups(spans, budget[0]):
            T = max(e - s for s, e in group)
            ids = torch.zeros(len(group), T, dtype=torch.long)
            attn, mask, adv, behav = (torch.zeros(len(group), T) for _ in range(4))
            for r, (s, e) in enumerate(group):
                ids[r, : e - s], attn[r, : e - s] = batch.input_ids[s:e], 1
                mask[r, : e - s], adv[r, : e - s] = batch.loss_mask[s:e], batch.advantages[s:e]
                behav[r, : e - s] = batch.behaviour_logprobs[s:e]
            ids, attn = ids.to(device), attn.long().to(device)
            mask, adv, behav = mask[:, 1:].to(device), adv[:, 1:].to(device), behav[:, 1:].to(device)
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
            logp = token_logprobs(logits, ids[:, 1:])
            loss, _ = ppo_policy_loss(
                logp,
                logp.detach(),
                behav,
                adv,
                mask,
                **opts,
                num_tokens=batch.global_num_tokens,
                num_seqs=batch.global_num_seqs,
                norm_tokens=norm_tokens,
            )
            with torch.no_grad():
                float((entropy_from_logits(logits) * mask).sum())  # the engine reports it too
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return model, step


def _padded_groups(spans: list[tuple[int, int]], budget: int) -> list[list[tuple[int, int]]]:
    groups: list[list[tuple[int, int]]] = [[]]
    longest = 0
    for s, e in spans:
        if groups[-1] and (len(groups[-1]) + 1) * max(longest, e - s) > budget:
            groups.append([])
            longest = 0
        groups[-1].append((s, e))
        longest = max(longest, e - s)
    return groups


# --- measuring -------------------------------------------------------------------------------
class Measured(NamedTuple):
    first_loss: float  # the first (warm-up) step's, on the initial weights
    last_loss: float  # the last timed step's, after warmup + steps - 1 updates
    step_s: float  # seconds per timed step
    peak_gb: float


def measure(
    step: Callable[[TrainBatch], float], batch: TrainBatch, device: torch.device, warmup: int, steps: int
) -> Measured | None:
    """The losses, seconds per timed step and peak GB, or None when it ran out of memory."""
    try:
        return _measure(step, batch, device, warmup, steps)
    except torch.OutOfMemoryError:
        _free(device)
        return None


def _measure(
    step: Callable[[TrainBatch], float], batch: TrainBatch, device: torch.device, warmup: int, steps: int
) -> Measured:
    first = step(batch)
    for _ in range(warmup - 1):
        step(batch)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    last = first
    for _ in range(steps):
        last = step(batch)
    _sync(device)
    elapsed = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0
    return Measured(first, last, elapsed, peak)


KERNEL_CLASSES = (  # the first pattern a kernel's name matches names its class
    ("attention", re.compile(r"flash|fmha|attn", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|matmul|splitk", re.I)),
    ("optimizer", re.compile(r"multi_tensor|adam|foreach", re.I)),
    ("copy/cast", re.compile(r"copy|memcpy|memset|cast|fill", re.I)),
)

# Ranges, not kernels: inductor's "## Call CompiledFxGraph <hash> ##" and the profiler's
# own step markers show up on the GPU timeline spanning the kernels they launched, so
# counting them counts those kernels twice (a compiled 4k step of 1.66 s read as 2.99 s of
# GPU time, 52 % of it "other").
ANNOTATION = re.compile(r"^## .* ##$|^ProfilerStep#")


def kernel_shares(kernels: list[tuple[str, float, int]]) -> tuple[float, dict[str, float]]:
    """The kernels' total time and each class's share of it (KERNEL_CLASSES, else "other"),
    largest first; `kernels` are (name, time, calls) with annotations already left out."""
    total = sum(k[1] for k in kernels) or 1.0
    classes: dict[str, float] = {}
    for name, us, _ in kernels:
        kind = next((c for c, pattern in KERNEL_CLASSES if pattern.search(name)), "other")
        classes[kind] = classes.get(kind, 0.0) + us / total
    return total, {k: round(v, 4) for k, v in sorted(classes.items(), key=lambda kv: -kv[1])}


def profile_step(
    step: Callable[[TrainBatch], float], batch: TrainBatch, device: torch.device, top: int, trace: Path | None = None
) -> dict:
    """One step under torch.profiler: GPU time per kernel class, the `top` kernels, and the
    `top` operators (with their input shapes) by the GPU time of their own kernels; with
    `trace`, the step's Chrome trace is written there."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA, ProfilerActivity.CPU] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities, record_shapes=True) as prof:
        step(batch)
        _sync(device)
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    if device.type == "cuda":  # the kernels themselves (an op's device time is its kernels')
        events = [e for e in prof.key_averages() if getattr(e, "device_type", None) == DeviceType.CUDA]
        kernels = [(e.key, e.self_device_time_total, e.count) for e in events if not ANNOTATION.match(e.key)]
    else:
        kernels = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()]
    kernels = [k for k in kernels if k[1] > 0]
    total, share = kernel_shares(kernels)
    kernels.sort(key=lambda k: -k[1])
    return {
        "gpu_s": total / 1e6,
        "share": share,
        "top": [{"kernel": n[:120], "ms": round(us / 1e3, 2), "calls": c} for n, us, c in kernels[:top]],
        "ops": _top_ops(prof, device, top),
    }


def _top_ops(prof: Any, device: torch.device, top: int) -> list[dict[str, Any]]:
    """The operators whose own kernels took the most device time (CPU: their own time), per
    input shape."""
    from torch.autograd import DeviceType

    def own(e: Any) -> float:
        return float(e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total)

    ops = [
        e
        for e in prof.key_averages(group_by_input_shape=True)
        if getattr(e, "device_type", None) == DeviceType.CPU and own(e) > 0
    ]
    ops.sort(key=lambda e: -own(e))
    return [
        {"op": e.key, "shapes": str(e.input_shapes)[:160], "ms": round(own(e) / 1e3, 2), "calls": e.count}
        for e in ops[:top]
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_cases(args: argparse.Namespace, model_dir: Path, device: torch.device, overrides: list[str]) -> dict[str, Any]:
    config = json.loads((model_dir / "config.json").read_text())
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    cases = {c: case_lengths(c, args.tokens, args.longest) for c in args.cases}
    batches = {c: make_batch(lengths, vocab) for c, lengths in cases.items()}
    result: dict[str, Any] = {"cases": {c: {"num_seqs": len(n), "tokens": sum(n)} for c, n in cases.items()}}
    engine_overrides = [*overrides, f"trainer.micro_batch_tokens={args.engine_budget}", *args.engine_option]
    result["engine_options"] = engine_overrides
    for name in args.loops:
        if name == "engine":
            model, step = engine_loop(model_dir, engine_overrides)
            num_params = sum(p.numel() for p in model.model.parameters())
        else:
            bare_budget = [args.budget]
            model, step = bare_loop(model_dir, overrides, device, bare_budget)
            num_params = sum(p.numel() for p in model.parameters())
        for case, batch in batches.items():
            measured = measure(step, batch, device, args.warmup, args.steps)
            while measured is None and name == "bare" and bare_budget[0] > 2048:
                bare_budget[0] //= 2  # out of memory: the plain loop with smaller micro-batches
                measured = measure(step, batch, device, args.warmup, args.steps)
            if measured is None:
                result["cases"][case][name] = {"oom": True}
                continue
            result["cases"][case][name] = entry = figures(measured, cases[case], num_params, hidden, layers, args)
            if name == "bare":
                entry["budget"] = bare_budget[0]
            elif args.profile:
                trace = args.trace / f"{case}.json.gz" if args.trace else None
                entry["profile"] = profile_step(step, batch, device, args.profile, trace)
            print(json.dumps({case: {name: entry}}), file=sys.stderr, flush=True)
        del model, step
        _free(device)
    result["num_params"] = num_params
    result.update(summary(result["cases"]))
    if args.variant:
        result["variants"] = run_variants(args, model_dir, device, engine_overrides, batches, cases, result["cases"])
    named = {"trainer.attention_kernel=fa4": "fa4 (flash-attn-4)", "trainer.attention_kernel=cudnn": "cudnn varlen"}
    chosen = [named[o] for o in engine_overrides if o in named]
    result["attention_kernel_cuda"] = chosen[-1] if chosen else cuda_kernel()  # the engine's
    return result


def figures(
    m: Measured, lengths: list[int], num_params: int, hidden: int, layers: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One loop's entry for one case: speed, MFU both ways, peak memory, losses."""
    peak_flops = args.peak_tflops * 1e12
    flops = train_flops(lengths, num_params, hidden, layers)
    flops_6n = train_flops(lengths, num_params, hidden, layers, attention=False)
    return {
        "step_s": m.step_s,
        "tokens_per_s": sum(lengths) / m.step_s,
        "mfu": flops / m.step_s / peak_flops,
        "mfu_6n": flops_6n / m.step_s / peak_flops,
        "peak_gb": m.peak_gb,
        "first_loss": m.first_loss,
        "last_loss": m.last_loss,
    }


def run_variants(
    args: argparse.Namespace,
    model_dir: Path,
    device: torch.device,
    base_options: list[str],
    batches: dict[str, TrainBatch],
    cases: dict[str, list[int]],
    measured: dict[str, Any],
) -> dict[str, Any]:
    """Each `--variant NAME KEY=VALUE...`: the engine with the base options plus its own, on
    the same cases; then the base engine once more (`base_again`), so machine drift over the
    run shows beside the ratios. Per variant and case: `speedup` (the base's step time, the
    mean of its two runs, over the variant's) and `last_loss_diff` against the base."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    runs = [(name, options) for name, *options in args.variant] + [("base_again", [])]
    out: dict[str, Any] = {}
    for name, options in runs:
        out[name] = {"options": options, "cases": {}}
        # Each engine compiles its own blocks afresh: code compiled for an earlier engine must
        # not count against dynamo's recompile limit (past it, blocks would run eager unseen).
        torch._dynamo.reset()
        try:
            model, step = engine_loop(model_dir, [*base_options, *options])
        except Exception as exc:  # a variant that cannot start is recorded, the others still run
            out[name]["error"] = one_line_error(exc)
            print(json.dumps({name: out[name]}), file=sys.stderr, flush=True)
            _free(device)
            continue
        num_params = sum(p.numel() for p in model.model.parameters())
        for case, batch in batches.items():
            try:
                m = measure(step, batch, device, args.warmup, args.steps)
                entry: dict[str, Any] = (
                    {"oom": True} if m is None else figures(m, cases[case], num_params, hidden, layers, args)
                )
                if m is not None and name != "base_again" and args.profile:
                    entry["profile"] = profile_step(step, batch, device, args.profile, None)
            except Exception as exc:
                entry = {"error": one_line_error(exc)}
            out[name]["cases"][case] = entry
            print(json.dumps({case: {name: entry}}), file=sys.stderr, flush=True)
        del model, step
        _free(device)
    for case in batches:
        base, again = measured[case].get("engine", {}), out["base_again"]["cases"].get(case, {})
        if "step_s" not in base or "step_s" not in again:
            continue
        base_s = (base["step_s"] + again["step_s"]) / 2
        again["drift"] = again["step_s"] / base["step_s"]
        for name, _ in runs[:-1]:
            entry = out[name]["cases"].get(case, {})
            if "step_s" in entry:
                entry["speedup"] = base_s / entry["step_s"]
                entry["last_loss_diff"] = abs(entry["last_loss"] - base["last_loss"])
    return out


def summary(c: dict[str, Any]) -> dict[str, Any]:
    """The top-level keys from the per-case results (None where a loop ran out of memory)."""
    ok = {k: v for k, v in c.items() if "mfu" in v.get("engine", {}) and "mfu" in v.get("bare", {})}
    mix = c.get("length_mix", {})
    speedup = mix["engine"]["tokens_per_s"] / mix["bare"]["tokens_per_s"] if "length_mix" in ok else None
    return {
        "mfu_4k": c.get("fixed_4k", {}).get("engine", {}).get("mfu"),
        "mfu_6n_4k": c.get("fixed_4k", {}).get("engine", {}).get("mfu_6n"),
        "mfu_6n_length_mix": c.get("length_mix", {}).get("engine", {}).get("mfu_6n"),
        "speedup_length_mix": speedup,
        "peak_gb": max((v.get("engine", {}).get("peak_gb", 0.0) for v in c.values()), default=0.0),
        "loss_match": all(abs(v["engine"]["first_loss"] - v["bare"]["first_loss"]) < 2e-2 for v in ok.values()),
    }


def run_memory(args: argparse.Namespace, model_dir: Path, device: torch.device, overrides: list[str]) -> dict[str, Any]:
    """One micro-batch of 16k tokens: chunked vs full logits, without and with activation recompute."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    per_seq = args.longest
    batch = make_batch([per_seq] * (16384 // per_seq if not args.quick else 4), vocab)
    out: dict[str, Any] = {"tokens": int(batch.cu_seqlens[-1])}
    budget = f"trainer.micro_batch_tokens={out['tokens']}"  # the whole batch is one micro-batch
    for recompute in ("false", "true"):
        runs: dict[str, Any] = {}
        for name, chunk in (("chunked", "1024"), ("full_logits", "0")):
            options = [*overrides, budget, f"trainer.gradient_checkpointing={recompute}", *args.engine_option]
            runs[name] = _step_memory(model_dir, [*options, f"trainer.logprob_chunk_tokens={chunk}"], batch, device)
            print(json.dumps({f"recompute={recompute}": {name: runs[name]}}), file=sys.stderr, flush=True)
        full, chunked = runs["full_logits"], runs["chunked"]
        if "peak_gb" in full and "peak_gb" in chunked and full["peak_gb"]:
            runs["peak_ratio"] = chunked["peak_gb"] / full["peak_gb"]
            runs["above_resident_ratio"] = chunked["above_resident_gb"] / full["above_resident_gb"]
        out["recompute_on" if recompute == "true" else "recompute_off"] = runs
    return out


def _step_memory(model_dir: Path, options: list[str], batch: TrainBatch, device: torch.device) -> dict[str, Any]:
    """Peak memory of the engine's second step on `batch` (the first makes the optimizer
    state), and above what was resident before it (weights, gradients, optimizer state)."""
    engine, step = engine_loop(model_dir, options)
    try:
        try:
            step(batch)
        except torch.OutOfMemoryError:
            return {"oom": True}
        _sync(device)
        resident = torch.cuda.memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0
        measured = measure(step, batch, device, 1, 1)
        if measured is None:
            return {"oom": True, "resident_gb": resident}
        peak = measured.peak_gb
        return {
            "peak_gb": peak,
            "resident_gb": resident,
            "above_resident_gb": peak - resident,
            "step_s": measured.step_s,
        }
    finally:
        del engine, step
        _free(device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true", help="tiny model on the CPU (seconds)")
    p.add_argument("--memory-16k", action="store_true", help="peak memory of a 16k-token micro-batch, chunked vs full")
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/tandem_bench_trainer_model"))
    p.add_argument("--cases", nargs="+", default=["fixed_1k", "fixed_4k", "length_mix"])
    p.add_argument("--tokens", type=int, default=65536, help="tokens per step, about")
    p.add_argument("--budget", type=int, default=16384, help="the bare loop's micro-batch tokens (rows x longest)")
    p.add_argument("--engine-budget", type=int, default=16384, help="the engine's trainer.micro_batch_tokens")
    p.add_argument("--engine-option", action="append", default=[], help="KEY=VALUE for the engine only (repeatable)")
    p.add_argument("--longest", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--loops", nargs="+", choices=["engine", "bare"], default=["engine", "bare"])
    p.add_argument("--profile", type=int, default=0, metavar="N", help="profile an engine step per case, top N kernels")
    p.add_argument("--trace", type=Path, default=None, metavar="DIR", help="with --profile: Chrome traces here")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    p.add_argument(
        "--variant",
        action="append",
        nargs="+",
        default=[],
        metavar=("NAME", "KEY=VALUE"),
        help="after the loops, the engine with these options added (repeatable); needs --loops engine",
    )
    args = p.parse_args(argv)
    if args.variant and ("engine" not in args.loops or args.memory_16k):
        p.error("--variant compares engine runs: it needs the engine loop (--loops engine) and no --memory-16k")
    if any("trainer.kernels=liger" in options for options in args.variant):
        p.error(
            "--variant with trainer.kernels=liger: Liger patches transformers' Qwen2 module for the whole "
            "process, so every run after it would run Liger's kernels too; give it as --engine-option"
        )
    for name, *options in args.variant:
        if not options or name == "base_again" or any("=" not in o for o in options) or "=" in name:
            p.error(f"--variant {name} {' '.join(options)}: give a name, then KEY=VALUE options")
    if "trainer.kernels=liger" in args.engine_option and "bare" in args.loops:
        p.error(
            "trainer.kernels=liger patches transformers' Qwen2 module for the whole process, so the bare "
            "loop would run Liger's kernels too: add --loops engine"
        )
    if args.quick:
        args.tokens, args.budget, args.engine_budget, args.longest, args.steps = 256, 128, 128, 64, 1
    # One process, one rank: its own rendezvous, whatever a parent process left in the environment.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    device = torch.device("cpu" if args.quick else "cuda")
    shape = QUICK if args.quick else QWEN25_15B
    model_dir = make_tiny_model(args.model_dir / ("quick" if args.quick else "qwen25_15b"), **shape)  # type: ignore[arg-type]
    overrides = [
        f"trainer.device={device.type}",
        "fsdp.param_dtype=float32",
        "trainer.optim.lr=1e-6",
        "trainer.optim.warmup_steps=0",
        "trainer.optim.grad_clip=1.0",
    ]
    if device.type == "cpu":
        overrides.append("fsdp.mixed_precision=null")
    else:  # as the bench configs train: bf16 compute, fp32 master weights and reduction
        overrides.append("fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: float32}")
    run = run_memory if args.memory_16k else run_cases
    result = {
        "benchmark": "trainer",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        **provenance(),
    }
    result.update(run(args, model_dir, device, overrides))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    raise SystemExit(main())
