"""Attention kernels for packed micro-batches, forward and backward alone. Prints one JSON object.

The trainer's attention at the 1.54B bench shape (12 query heads, 2 KV heads, head
dim 128; `--heads/--kv-heads/--head-dim` for others) on the cases of benchmarks/trainer.py
(`fixed_4k`: 4 sequences of 4096 tokens; `length_mix`: log-uniform lengths, about 16,384
tokens), each kernel on the same bf16 inputs:

* `torch`: the engine's path as it runs today (roles/kernels/varlen.py: PyTorch's
  FlashAttention-2 varlen on CUDA, one SDPA per sequence on the CPU), through the same
  transformers-layout entry point the model calls;
* `fa4`: the engine's `trainer.attention_kernel=fa4` path (flash-attn-4's CuTe kernels), where
  the package imports;
* `cudnn`: the engine's `trainer.attention_kernel=cudnn` path (cuDNN's varlen attention through
  `aten._cudnn_attention_forward/backward` with cumulative sequence lengths, GQA native),
  CUDA only; `cudnn_repeat`: the same op with K and V repeated to the query heads first (in
  case cuDNN's GQA is the slower or the failing part);
* `sdpa_padded`: `scaled_dot_product_attention` on a `[sequences, heads, length, dim]` batch
  (only where every sequence has the same length, so nothing is padded), on CUDA under cuDNN's
  backend (`SDPBackend.CUDNN_ATTENTION`, K and V repeated to the query heads), on the CPU under
  the default choice (GQA native).

Per kernel: the median over `--iters` timed calls (after `--warmup`) of the forward alone
(`fwd_ms`) and of forward plus backward (`fwd_bwd_ms`), the attention TFLOP/s of the latter
(causal FLOPs, 2·Σlen²·heads·dim forward and twice that backward, as benchmarks/trainer.py
counts them), `vs_torch` (the `torch` kernel's time over this one's: above 1 is faster), and
`max_rel_diff`: over its output and the three input gradients, the largest absolute
difference from the `torch` kernel's relative to that tensor's largest magnitude (bf16
kernels that agree differ by about 1e-2 at most). A kernel that fails records its one-line `error` and the others go on.

    python3 benchmarks/attention.py [--cases fixed_4k length_mix] \\
        [--kernels torch fa4 cudnn cudnn_repeat sdpa_padded] [--out benchmarks/results/attention_h200x1.json]
    .venv/bin/python benchmarks/attention.py --quick       # CPU: tiny shapes, checks the harness
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.json_out import one_line_error, print_json, provenance
from benchmarks.trainer import case_lengths

KERNELS = ("torch", "fa4", "cudnn", "cudnn_repeat", "sdpa_padded")
# A kernel: (q, k, v as [T, H, D] with K/V at their own head count, cu int32 [N + 1], longest, scale) -> [T, H, D]
Kernel = Callable[[Tensor, Tensor, Tensor, Tensor, int, float], Tensor]


def attention_flops(lengths: list[int], heads: int, head_dim: int) -> float:
    """Causal attention FLOPs of forward plus backward: forward 2·Σlen²·heads·dim (half of
    QKᵀ and PV's 4·len²·dim each, the upper triangle masked), backward twice the forward."""
    return 6.0 * sum(n * n for n in lengths) * heads * head_dim


def _engine(forward: Callable[..., tuple[Tensor, None]]) -> Kernel:
    """A transformers attention backend of the engine, called as the model calls it
    (q/k/v `[1, H, T, D]`, `cu_seq_lens_q`, `max_length_q`)."""

    def run(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, longest: int, scale: float) -> Tensor:
        layout = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)]  # [1, H, T, D], as the model's projections give
        out, _ = forward(None, *layout, None, scaling=scale, cu_seq_lens_q=cu, max_length_q=longest)
        return out[0]  # [T, H, D]

    return run


def _cudnn_repeat(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, longest: int, scale: float) -> Tensor:
    from roles.kernels.varlen_cudnn import cudnn_varlen

    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1).contiguous() if groups > 1 else x for x in (k, v))
    return cudnn_varlen(q, k, v, cu, longest, scale)[0]


def _sdpa_padded(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, longest: int, scale: float) -> Tensor:
    seqs = cu.numel() - 1
    if q.shape[0] != seqs * longest:
        raise ValueError("sdpa_padded runs only on sequences of one length (nothing padded)")
    qb, kb, vb = (x.view(seqs, longest, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))  # [N, H, L, D]
    gqa = q.shape[1] != k.shape[1]
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        groups = q.shape[1] // k.shape[1]  # K/V repeated, as for `cudnn_repeat`: cuDNN's SDPA may refuse enable_gqa
        kb, vb = (x.repeat_interleave(groups, dim=1) if groups > 1 else x for x in (kb, vb))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(q.shape)


def kernel(name: str, device: torch.device) -> Kernel:
    """The kernel called `name` (KERNELS); a ValueError/RuntimeError/ImportError says why it cannot run here."""
    if name == "torch":
        from roles.kernels.varlen import varlen_attention_forward

        return _engine(varlen_attention_forward)
    if name == "fa4":
        if device.type != "cuda":
            raise ValueError("fa4 needs a CUDA GPU (on the CPU the engine's fa4 setting takes the torch path)")
        from roles.kernels.varlen_fa4 import _interface, fa4_attention_forward

        _interface()  # the package, or the engine's one-line reason
        return _engine(fa4_attention_forward)
    if name in ("cudnn", "cudnn_repeat"):
        if device.type != "cuda":
            raise ValueError(f"{name} needs a CUDA GPU (on the CPU the engine's cudnn setting takes the torch path)")
        from roles.kernels.varlen_cudnn import cudnn_attention_forward

        return _engine(cudnn_attention_forward) if name == "cudnn" else _cudnn_repeat
    if name == "sdpa_padded":
        return _sdpa_padded
    raise ValueError(f"unknown kernel {name!r} (known: {', '.join(KERNELS)})")


def inputs(lengths: list[int], heads: int, kv_heads: int, head_dim: int, device: torch.device, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)

    def rand(h: int) -> Tensor:
        return torch.randn(tokens, h, head_dim, generator=g).to(device, torch.bfloat16)

    return {
        "q": rand(heads),
        "k": rand(kv_heads),
        "v": rand(kv_heads),
        "grad": rand(heads),
        "cu": torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device),
        "longest": max(lengths),
        "scale": head_dim**-0.5,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_kernel(fn: Kernel, x: dict, device: torch.device, warmup: int, iters: int) -> dict[str, Any]:
    """Times of `fn` on `x` (forward; forward + backward) and its output and gradients."""
    q, k, v = (x[n].detach().requires_grad_(True) for n in ("q", "k", "v"))

    def fwd() -> Tensor:
        return fn(q, k, v, x["cu"], x["longest"], x["scale"])

    def fwd_bwd() -> Tensor:
        q.grad = k.grad = v.grad = None
        out = fwd()
        out.backward(x["grad"])
        return out

    times: dict[str, float] = {}
    for label, call in (("fwd_ms", fwd), ("fwd_bwd_ms", fwd_bwd)):
        for _ in range(warmup):
            call()
        runs = []
        for _ in range(iters):
            _sync(device)
            start = time.perf_counter()
            call()
            _sync(device)
            runs.append((time.perf_counter() - start) * 1e3)
        times[label] = statistics.median(runs)
    out = fwd_bwd().detach()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return {**times, "tensors": (out, q.grad.clone(), k.grad.clone(), v.grad.clone())}


def max_rel_diff(a: tuple[Tensor, ...], b: tuple[Tensor, ...]) -> float:
    """Over the tensors of `a` and `b` (output, dq, dk, dv): the largest max|a - b| / max|b|."""
    return max(float((x.float() - y.float()).abs().max() / y.float().abs().max()) for x, y in zip(a, b, strict=True))


def run_case(lengths: list[int], names: list[str], args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    x = inputs(lengths, args.heads, args.kv_heads, args.head_dim, device)
    flops = attention_flops(lengths, args.heads, args.head_dim)
    results: dict[str, Any] = {}
    reference = None
    for name in names:
        try:
            r = run_kernel(kernel(name, device), x, device, args.warmup, args.iters)
            tensors = r.pop("tensors")
            if name == "torch":
                reference = (tensors, r["fwd_bwd_ms"])
            r["tflops"] = flops / (r["fwd_bwd_ms"] / 1e3) / 1e12
            if reference is not None:
                r["vs_torch"] = reference[1] / r["fwd_bwd_ms"]
                r["max_rel_diff"] = max_rel_diff(tensors, reference[0])
        except Exception as exc:  # one kernel's failure is its result; the others still run
            results[name] = {"error": one_line_error(exc)}
            continue
        results[name] = r
        del tensors
    return {
        "sequences": len(lengths),
        "tokens": sum(lengths),
        "longest": max(lengths),
        "attention_flops": flops,
        "kernels": results,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cases", nargs="+", default=["fixed_4k", "length_mix"], choices=["fixed_1k", "fixed_4k", "length_mix"]
    )
    p.add_argument(
        "--kernels",
        nargs="+",
        default=list(KERNELS),
        choices=KERNELS,
        help="torch first: the others are compared with it",
    )
    p.add_argument("--tokens", type=int, default=16384, help="tokens per case (one micro-batch), about")
    p.add_argument("--longest", type=int, default=4096)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="CPU-sized: 256 tokens, sequences up to 64, 2 iterations")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.kernels[0] != "torch":
        p.error("--kernels: torch must come first (the others are compared with it)")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if args.quick:
        args.tokens, args.longest, args.warmup, args.iters = 256, 64, 1, 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases = {c: run_case(case_lengths(c, args.tokens, args.longest), args.kernels, args, device) for c in args.cases}
    result = {
        "benchmark": "attention",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim},
        "warmup": args.warmup,
        "iters": args.iters,
        "cases": cases,
        **provenance(),
    }
    print_json(result, args.out)


if __name__ == "__main__":
    main()
