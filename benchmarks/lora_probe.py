"""Does this machine's vLLM serve LoRA adapters, and can one be loaded from tensors (no file)?

    python3 benchmarks/lora_probe.py --out lora_probe.json            # tiny random Qwen2, CPU or GPU
    python3 benchmarks/lora_probe.py --out p.json --model /path/to/hf  # any Qwen2/Llama-shaped model

Starts one `vllm.LLM` with `enable_lora=True` (`--rank` = `max_lora_rank`, `max_loras=2`), makes
two random adapters in PEFT's layout (q/k/v/o and gate/up/down, `lora_alpha = 2 * rank`), and
greedy-decodes one prompt: without an adapter; with adapter 1 from a PEFT directory (a
`LoRARequest` path); with adapter 2 loaded from tensors inside the worker (`LoRAModel.
from_lora_tensors` + the worker's adapter manager, through a `worker_extension_cls` method,
then a `LoRARequest` whose path is never read); with adapter 2 from a directory; without an
adapter again. The tensor-loaded and directory-loaded runs of adapter 2 must agree exactly and
the base runs must be unchanged. Adapter 1's tokens are then scored by transformers with the
adapter merged by hand (W + alpha/r * B @ A, float32): `max_abs_logprob_diff_vs_merged` is
vLLM's behaviour logprob against that (bf16 noise is ~1e-2), `control_diff_vs_base_model` the
same against the model without the adapter (large: the check can tell).

Prints one JSON object and writes it to `--out`. No PEFT needed: the adapters are written here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load, save, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is for the JSON

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = [10, 20, 30, 40, 50, 60]


class ProbeExt:
    """vLLM worker extension: `probe_add_lora_tensors` registers an adapter from bytes."""

    model_runner: Any

    def probe_add_lora_tensors(self, lora_id: int, config_json: str, payload: bytes) -> list[int]:
        """Build a LoRAModel from safetensors bytes and make it adapter `lora_id` (the rollout's
        own path, roles/weights/lora_worker.py); returns the worker's adapter ids. A later
        request with `LoRARequest(..., lora_id, path)` finds it loaded and never reads `path`."""
        from roles.weights.lora_worker import register_from_tensors

        manager = self.model_runner.lora_manager
        register_from_tensors(manager, lora_id, load(payload), json.loads(config_json))
        return sorted(manager.list_adapters())


def make_adapter(hf_config: Any, rank: int, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Random PEFT-named LoRA tensors for every layer's TARGETS, and their adapter_config."""
    g = torch.Generator().manual_seed(seed)
    h, inter = hf_config.hidden_size, hf_config.intermediate_size
    kv = hf_config.num_key_value_heads * getattr(hf_config, "head_dim", h // hf_config.num_attention_heads)
    q = hf_config.num_attention_heads * getattr(hf_config, "head_dim", h // hf_config.num_attention_heads)
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    shapes |= {"gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for m in TARGETS:
            fan_in, fan_out = shapes[m]
            part = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[name + ".lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            tensors[name + ".lora_B.weight"] = torch.randn(fan_out, rank, generator=g) / rank**0.5
    config = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS), bias="none")
    return tensors, config | dict(task_type="CAUSAL_LM", lora_dropout=0.0)


def write_adapter(out: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> str:
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config))
    return str(out)


def merged_logprobs(model_dir: str, tensors: dict[str, torch.Tensor], scale: float, tokens: list[int]) -> list[float]:
    """transformers' float32 logprobs of `tokens` after PROMPT with the adapter merged by hand."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." in name:
                module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[name.replace(".lora_A.", ".lora_B.")]
                params[module + ".weight"].add_(scale * (b.float() @ a.float()))
        ids = torch.tensor([PROMPT + tokens])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    pos = range(len(PROMPT) - 1, len(PROMPT) - 1 + len(tokens))
    return [float(logp[p, t]) for p, t in zip(pos, tokens, strict=True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="where to write the JSON result")
    p.add_argument("--model", default="", help="HF model directory (default: a tiny random Qwen2)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    work = Path(tempfile.mkdtemp(prefix="lora_probe."))
    model_dir = args.model
    if not model_dir:
        from runtime.tiny.model import make_tiny_model

        # head_dim 64: the GPU attention kernels (FA3) do not take the default tiny head_dim 32.
        model_dir = str(make_tiny_model(work / "tiny", hidden_size=256, num_heads=4, num_kv_heads=2))
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    hf_config = AutoConfig.from_pretrained(model_dir)
    t1, c1 = make_adapter(hf_config, args.rank, 1)
    t2, c2 = make_adapter(hf_config, args.rank, 2)
    dir1 = write_adapter(work / "adapter1", t1, c1)
    result: dict[str, Any] = dict(vllm=__import__("vllm").__version__, torch=torch.__version__, host=platform.node())
    started = time.perf_counter()
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=256,
        enforce_eager=True,
        enable_lora=True,
        max_lora_rank=args.rank,
        max_loras=2,
        max_num_seqs=8,
        gpu_memory_utilization=0.3,
        worker_extension_cls="benchmarks.lora_probe.ProbeExt",
    )
    result["init_s"] = round(time.perf_counter() - started, 1)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, logprobs=0, detokenize=False)

    def run(req: Any) -> tuple[list[int], list[float]]:
        prompt: Any = {"prompt_token_ids": PROMPT}
        out: Any = llm.generate([prompt], params, lora_request=req, use_tqdm=False)[0].outputs[0]
        return list(out.token_ids), [float(e[t].logprob) for t, e in zip(out.token_ids, out.logprobs, strict=True)]

    base = run(None)
    adapter1 = run(LoRARequest("a1", 1, dir1))
    started = time.perf_counter()
    ids = llm.collective_rpc("probe_add_lora_tensors", args=(2, json.dumps(c2), save(t2)))
    result["tensor_load_s"] = round(time.perf_counter() - started, 4)
    from_tensors = run(LoRARequest("a2", 2, str(work / "never-read")))
    from_dir = run(LoRARequest("a2-dir", 3, write_adapter(work / "adapter2", t2, c2)))
    base_again = run(None)
    merged = merged_logprobs(model_dir, t1, c1["lora_alpha"] / c1["r"], adapter1[0])
    unmerged = merged_logprobs(model_dir, t1, 0.0, adapter1[0])  # the control: the same check without the adapter
    result |= dict(
        worker_adapter_ids=ids,
        adapter_changes_output=adapter1 != base and from_tensors != base,
        tensor_equals_dir=from_tensors == from_dir,
        base_unchanged=base == base_again,
        max_abs_logprob_diff_vs_merged=round(max(abs(a - b) for a, b in zip(adapter1[1], merged, strict=True)), 4),
        control_diff_vs_base_model=round(max(abs(a - b) for a, b in zip(adapter1[1], unmerged, strict=True)), 4),
        adapter_bytes=sum(t.numel() * t.element_size() for t in t2.values()),
    )
    result["ok"] = bool(
        result["adapter_changes_output"]
        and result["tensor_equals_dir"]
        and result["base_unchanged"]
        and result["max_abs_logprob_diff_vs_merged"] < 0.1
    )
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
