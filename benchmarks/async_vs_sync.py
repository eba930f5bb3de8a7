"""Async vs sync PPO on one config, in one invocation. Prints one JSON object.

The same config runs as separate `tandem launch` processes, each into its own run
directory under `--run-root`, in this order:

* sync: `rollout.max_staleness=0` — on-policy PPO through the same code path (the baseline);
* async: `rollout.max_staleness=N` (`--staleness`, default 2);
* colocated (`--colocated`): sync again, with rollout and trainer each given every GPU
  the config uses (one rollout and one trainer rank per GPU, sharing it; the rollout's
  `gpu_memory_utilization` lowered to `--colocated-gpu-util` so both fit).

`--only NAME` (repeatable) runs only the named variants (then no speedup). `--reuse`
summarises, instead of running again, every variant whose run directory under `--run-root`
already holds a finished run (as many step records as its `trainer.total_steps`): a
variant that outlasts one command's time limit runs alone (`--only sync`), and a later
invocation with the same `--run-root` and `--reuse` runs the rest and reports both (a reused
variant's `launch_s` and GPU peaks are the ones its own invocation wrote into its run directory).
Each variant reports every role's GPU memory as nvidia-smi saw it at its highest
(`gpu_process_peak_gb`, sampled each second while the run lasts; a rollout's vLLM engine
process counts under it) beside what the plan gave that process (`plan_process_gb`,
`process_over_plan`: above 1.0 it outgrew its share). Each variant
also reports trainer rank 0's measured `cuda_peak_gb` beside the launch-time memory plan's
estimate of it (`plan_trainer_peak_gb`, `plan_over_measured_peak`), its process's resident
high-water mark `host_peak_gb` beside the plan's host memory for it (`plan_trainer_host_gb`,
`plan_over_measured_host`: what offload puts there), and the trainer's training time per step
(`train_s_per_step`) beside the plan's estimate of it made before the run (`plan_train_s`, its
parts in `plan_train_s_parts`, `plan_over_measured_train_s`).

Each run's metrics.jsonl is then summarised over its steady window: the first
`--warmup-steps` steps are skipped, and so are the last `max_staleness` steps of a run,
in which nothing is generated any more (the samples they train were generated ahead, so
they would flatter the async run); at least one step is kept. Rates are totals over the
window (samples / sum of step times); `run_samples_per_s` is the whole run's. Weight-sync
time (and each of its phases, `weight_sync_gather_s` / `_transfer_s` / `_load_s`) is the
median step. `wall_over_max_busy` is the window's wall time over the busier
side's busy time (rollout or trainer): 1.0 is perfect overlap, sync PPO sits near
(gen + train) / max(gen, train). `trainer_mfu` is 6 * params * trained tokens (prompt + response) /
train_busy_s / peak FLOP/s of the trainer's GPUs (`--peak-tflops` each, default H200 bf16
dense); it ignores attention and the proximal-logprob forward, so it understates the work
done. `trainer_mfu_alone` is the same over the steps after the warm-up in which nothing was
generated (an async run's last max_staleness steps): on a GPU the rollout shares, the
trainer's MFU without generation beside it, so `trainer_mfu` / `trainer_mfu_alone` is
the cost of sharing the GPU (null where every step generated). `weight_sync_gbps` is the
policy's size in bf16 (from the model's config.json) over the median weight-sync time, in
10^9 bytes per second. `rollout_vs_bare_vllm` is `role_over_bare` of a
benchmarks/rollout.py result (`--rollout-bench FILE`), else null.

Samples/s alone flatters a run that drops its long samples: a group that takes longer to
generate than max_staleness steps is dropped as stale, not trained, so with long-tail
lengths an async run trains shorter samples than the sync one (on one H200, 1.54B, log-normal
budgets of mean 512 capped at 2048, staleness 2 dropped 30 of the 31 groups over 1500
tokens). So every variant also reports `response_tokens_mean` (trained response tokens per
sample), `dropped_stale` (samples dropped as stale in the window) and
`dropped_stale_fraction` (of those trained and dropped there), and the comparison
`speedup_tokens` (async over sync in trained response tokens/s) and
`async_dropped_stale_fraction`: read `speedup` with them.

`--repeats N` (N > 1) runs the variants N times, alternating (sync, async, sync, async, ...),
each run into `RUN_ROOT/NAME-R`, and every run gets `trainer.total_steps` = warm-up +
`--measured-steps` (default 20 with repeats) + its own max_staleness, so each keeps at least
that many measured steps. The JSON then holds every repeat (`repeats`: one object per repeat
with its variants' summaries and its `speedup`), `spread` (median, min, max and the samples of
each variant's samples_per_s and of the per-repeat async/sync ratio), `speedup` = the median
ratio, and `variants` = each variant's median-samples/s run. With one repeat the output is
as before (no `repeats`, no `spread`).

`--add-to FILE` adds this invocation's repeats to those of an earlier JSON of this benchmark
(a repeats file, or a one-repeat one) and reports the spread over all of them: repeats too
long for one sitting (three long-tail pairs take about 31 minutes on one H200) can be taken
in several. The earlier file must have the same config, overrides, staleness, warm-up,
params and measured steps (the first that differs is named). Every repeat records when and
where it ran (`measured_at`, `host`, `commit`: `$TANDEM_COMMIT`, else git's HEAD with
`-dirty` for a changed tree): each repeat's sync and async runs share a machine, so its ratio
is like for like even when repeats do not.

`--gpus 0,1` runs the repeats side by side, one per GPU at a time (benchmarks/gpu_slots.py):
each repeat's runs, sync then async, go to one GPU (their launches see only it:
`CUDA_VISIBLE_DEVICES`), and the next repeat goes to the first GPU that is free; each repeat
in the JSON names its `gpu`. Only for configs placed on one GPU. On a 2x H200 host three
repeats take two repeats' time.

    .venv/bin/python benchmarks/async_vs_sync.py [--config configs/bench_h200x2.yaml] [key=value ...]
        [--colocated] [--rollout-bench FILE] [--out benchmarks/results/async_vs_sync_h200x2.json]
        [--repeats 3 [--measured-steps 20] [--gpus 0,1]] [--add-to EARLIER.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu_process_peaks import PeakSampler
from benchmarks.gpu_slots import Job, check_one_gpu, parse_gpus, run_spread
from benchmarks.json_out import print_json, provenance, read_earlier
from runtime.config import RunConfig
from runtime.config.placement import entries, role_counts
from runtime.memory.auto import load_settled
from runtime.memory.estimate import ModelShape
from runtime.preflight.environment import check_launch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = "configs/bench_h200x2.yaml"
H200_BF16_DENSE_TFLOPS = 989.0
BF16_BYTES = 2


# --- summarising (pure) ---------------------------------------------------------------
def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The step records (validation records, `kind: validation`, left out)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if "kind" not in r]


def summarize_run(
    records: list[dict[str, Any]],
    *,
    warmup: int,
    cooldown: int = 0,
    params: int,
    policy_bytes: int,
    prompt_tokens: float,
    peak_flops: float,
) -> dict[str, Any]:
    """One run's figures over its steps but the first `warmup` and the last `cooldown`."""
    ordered = sorted(records, key=lambda r: r["step"])
    kept = ordered[warmup : len(ordered) - cooldown]
    if not kept:
        raise ValueError(f"{len(records)} steps recorded, none left without {warmup} warm-up and {cooldown} last steps")
    wall = sum(r["step_s"] for r in kept)
    samples = sum(r["samples_per_s"] * r["step_s"] for r in kept)
    tokens = sum(r["tokens_per_s"] * r["step_s"] for r in kept)
    dropped = sum(r.get("dropped_stale", 0) for r in kept)
    gen_busy = sum(r["gen_busy_s"] for r in kept)
    train_busy = sum(r["train_busy_s"] for r in kept)
    sync_s = statistics.median(r["weight_sync_s"] for r in kept)
    pushed = [r["weight_sync_gb"] for r in kept if "weight_sync_gb" in r]
    kls = [r["kl_behaviour_proximal"] for r in ordered if "kl_behaviour_proximal" in r]
    phases = {
        k: statistics.median(r[k] for r in kept) if all(k in r for r in kept) else None
        for k in ("weight_sync_gather_s", "weight_sync_transfer_s", "weight_sync_load_s")
    }
    return {
        "steps": len(kept),
        "samples_per_s": samples / wall,
        "tokens_per_s": tokens / wall,
        "response_tokens_mean": tokens / samples if samples else None,
        "dropped_stale": dropped,
        "dropped_stale_fraction": dropped / (dropped + samples) if dropped + samples else 0.0,
        "wall_s": wall,
        "run_wall_s": ordered[-1]["wall_s"],
        "run_samples_per_s": sum(r["samples_per_s"] * r["step_s"] for r in ordered) / ordered[-1]["wall_s"],
        "step_s_median": statistics.median(r["step_s"] for r in kept),
        "gen_busy_s": gen_busy,
        "train_busy_s": train_busy,
        "wall_over_max_busy": wall / max(gen_busy, train_busy),
        "rollout_idle_ratio": max(0.0, 1.0 - gen_busy / wall),
        "trainer_idle_ratio": max(0.0, 1.0 - train_busy / wall),
        "weight_sync_s": sync_s,
        "weight_sync_gbps": policy_bytes / sync_s / 1e9 if sync_s > 0 else None,
        "weight_sync_gb_pushed": statistics.median(pushed) if pushed else None,
        **phases,
        "trainer_mfu": trainer_mfu(kept, params=params, prompt_tokens=prompt_tokens, peak_flops=peak_flops),
        "trainer_mfu_alone": trainer_mfu(
            [r for r in ordered[warmup:] if r["gen_busy_s"] == 0 and r["train_busy_s"] > 0],
            params=params,
            prompt_tokens=prompt_tokens,
            peak_flops=peak_flops,
        ),  # the steps with no generation beside the trainer (an async run's last max_staleness)
        "staleness_mean": statistics.fmean(r["staleness_mean"] for r in kept),
        "staleness_max": max(r["staleness_max"] for r in kept),
        # Over every step, warm-up included: the rollout samples from the trainer's weights
        # only if this stays at bf16 noise (~1e-3) from the first update on.
        "kl_behaviour_proximal_max": max(kls) if kls else None,
        **routing_figures(kept),
    }


def routing_figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    """A mixture of experts' routing over the steps (token-weighted means), where reported:
    `router_disagree` (how often the trainer's router would route a token otherwise than vLLM
    did) and `routing_mismatch` (how often it did: 0 under routing replay)."""
    rows = [r for r in records if r.get("routed_tokens")]
    if not rows:
        return {}
    tokens = sum(r["routed_tokens"] for r in rows)
    return {
        key: sum(r[key] * r["routed_tokens"] for r in rows) / tokens for key in ("router_disagree", "routing_mismatch")
    }


def trainer_mfu(records: list[dict[str, Any]], *, params: int, prompt_tokens: float, peak_flops: float) -> float | None:
    """6 * params * trained tokens (response + prompt) over the steps' training busy time and
    `peak_flops`; None when the steps trained for no time (or there are none)."""
    busy = sum(r["train_busy_s"] for r in records)
    if busy <= 0:
        return None
    tokens = sum((r["tokens_per_s"] + r["samples_per_s"] * prompt_tokens) * r["step_s"] for r in records)
    return 6 * params * tokens / busy / peak_flops


def compare(variants: dict[str, dict[str, Any]], rollout_bench: dict[str, Any] | None) -> dict[str, Any]:
    """The headline figures: async over sync (and over colocated sync), async's own figures."""
    if "async" not in variants or "sync" not in variants:  # --only: no comparison
        return {"speedup": None, "rollout_vs_bare_vllm": rollout_bench.get("role_over_bare") if rollout_bench else None}
    a, s = variants["async"], variants["sync"]
    out = {
        "speedup": a["samples_per_s"] / s["samples_per_s"],
        "speedup_tokens": a["tokens_per_s"] / s["tokens_per_s"],
        "async_dropped_stale_fraction": a["dropped_stale_fraction"],
    }
    if "colocated" in variants:
        out["speedup_vs_colocated"] = a["samples_per_s"] / variants["colocated"]["samples_per_s"]
    for key in ("wall_over_max_busy", "weight_sync_s", "weight_sync_gbps", "trainer_mfu"):
        out[key] = a[key]
    out["rollout_vs_bare_vllm"] = rollout_bench.get("role_over_bare") if rollout_bench else None
    return out


def spread(values: list[float]) -> dict[str, Any]:
    """Median, min and max of `values`, and the values themselves."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "samples": values}


def aggregate_repeats(repeats: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Over repeats (each: variant name -> its summary): the spread of each variant's
    samples/s and of the per-repeat async/sync ratios (`speedup`: of samples/s,
    `speedup_tokens`: of trained response tokens/s); `median_runs`: each variant's run with
    the median samples/s (the lower middle one of an even count)."""
    names = list(repeats[0])
    out: dict[str, Any] = {
        name: {"samples_per_s": spread([r[name]["samples_per_s"] for r in repeats])} for name in names
    }
    if "sync" in names and "async" in names:
        out["speedup"] = spread([r["async"]["samples_per_s"] / r["sync"]["samples_per_s"] for r in repeats])
        out["speedup_tokens"] = spread([r["async"]["tokens_per_s"] / r["sync"]["tokens_per_s"] for r in repeats])
    median_runs = {}
    for name in names:
        rate = statistics.median_low(r[name]["samples_per_s"] for r in repeats)
        median_runs[name] = next(r[name] for r in repeats if r[name]["samples_per_s"] == rate)
    return {"spread": out, "median_runs": median_runs}


def steps_override(cfg: RunConfig, warmup: int, measured: int | None) -> list[str]:
    """`trainer.total_steps` that leaves `measured` steps after the warm-up and the last
    max_staleness steps (none: the config's own)."""
    if measured is None:
        return []
    return [f"trainer.total_steps={warmup + measured + cfg.rollout.max_staleness}"]


def decoder_param_count(hf: dict[str, Any]) -> int:
    """Parameters of a Qwen2 / Llama-shaped decoder from its HF config.json."""
    h, num_layers, vocab = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or h // heads
    bias = hf.get("attention_bias", hf.get("model_type") == "qwen2")  # Qwen2 always has q/k/v biases
    q, kv = heads * head_dim, kv_heads * head_dim
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if bias else 0)
    mlp = 3 * h * hf["intermediate_size"]
    layer = attn + mlp + 2 * h  # two RMSNorms
    embeddings = vocab * h * (1 if hf.get("tie_word_embeddings") else 2)
    return embeddings + num_layers * layer + h  # final norm


def colocated_placement(cfg: RunConfig) -> list[dict[str, Any]]:
    """Controller and reward as they are; one rollout and one trainer (and critic) per GPU used."""
    gpus = sorted({d for e in entries(cfg) if e.role in ("rollout", "trainer", "critic") for d in e.devices})
    if not gpus:
        raise ValueError("--colocated: the config puts no role on a GPU, so there is nothing to colocate")
    shared = {"count": len(gpus), "devices": gpus}
    roles = ["rollout", "trainer"] + (["critic"] if role_counts(cfg).get("critic") else [])
    return [{"role": "controller"}, {"role": "reward"}, *({"role": r, **shared} for r in roles)]


def variant_overrides(cfg: RunConfig, staleness: int, colocated_util: float | None) -> dict[str, list[str]]:
    """Overrides of each variant, applied after the user's; `colocated_util` None: no colocated run."""
    out = {"sync": ["rollout.max_staleness=0"], "async": [f"rollout.max_staleness={staleness}"]}
    if colocated_util is not None:
        out["colocated"] = [
            "rollout.max_staleness=0",
            f"placement={json.dumps(colocated_placement(cfg))}",
            f"rollout.engine.gpu_memory_utilization={colocated_util}",
            "weight_sync.backend=auto",  # ipc: NCCL cannot hold trainer rank 0 and a rollout on one GPU
        ]
    return out


def rounded(value: Any) -> Any:
    """Floats to 4 significant digits, through dicts and lists."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


# --- running --------------------------------------------------------------------------
def setup_model(cfg: RunConfig, run_root: Path) -> tuple[Path, list[str]]:
    """The policy directory and the overrides that point every variant at it: the tiny model
    is made once under `run_root` (not once per variant)."""
    if cfg.model.path:
        return Path(cfg.model.path), []
    import msgspec

    from runtime.tiny.model import make_tiny_model

    path = make_tiny_model(run_root / "model", **msgspec.structs.asdict(cfg.model.tiny))
    return path, [f"model.path={path}"]


def prompt_tokens_mean(cfg: RunConfig, model_path: Path, limit: int = 256) -> float:
    """Mean prompt length in tokens, as the controller encodes the dataset's prompts."""
    from transformers import AutoTokenizer

    from roles.controller.dataset import PromptDataset

    dataset = PromptDataset(cfg.data, AutoTokenizer.from_pretrained(str(model_path)), cfg.seed)
    return statistics.fmean(len(dataset.next().prompt_ids) for _ in range(min(limit, len(dataset))))


def launch(
    config: Path, overrides: list[str], log_path: Path, timeout_s: float, env: dict[str, str] | None = None
) -> float:
    """`tandem launch` in a subprocess (`env` added to this process's environment); its wall
    time. A failed run ends the benchmark."""
    cmd = [sys.executable, "-m", "runtime.cli", "launch", str(config), *overrides]
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        try:
            code = proc.wait(timeout=timeout_s)
            why = f"exited {code}"
        except subprocess.TimeoutExpired:
            _stop(proc)
            code, why = None, f"timed out after {timeout_s:g}s"
    if code != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise SystemExit(f"async_vs_sync: `{' '.join(cmd)}` {why}; end of {log_path}:\n{tail}")
    return time.perf_counter() - started


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)  # the launcher stops every role it started, then exits
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every variant")
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--staleness", type=int, default=2, help="rollout.max_staleness of the async variant")
    parser.add_argument("--colocated", action="store_true", help="also run sync with rollout and trainer colocated")
    parser.add_argument("--colocated-gpu-util", type=float, default=0.5, help="rollout GPU share when colocated")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS, help="per trainer GPU")
    parser.add_argument("--rollout-bench", type=Path, help="JSON printed by benchmarks/rollout.py")
    parser.add_argument("--run-root", type=Path, help="default: runs/async_vs_sync/<config>-<time>")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per variant")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs of every variant")
    parser.add_argument(
        "--measured-steps", type=int, help="steps kept per run (sets total_steps); 20 with --repeats > 1 or --add-to"
    )
    parser.add_argument("--reuse", action="store_true", help="summarise variants already finished under --run-root")
    parser.add_argument("--gpus", type=parse_gpus, help="spread the repeats over these GPUs (e.g. 0,1)")
    parser.add_argument(
        "--add-to",
        type=Path,
        metavar="FILE",
        help="an earlier JSON of this benchmark: its repeats are kept and these added",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=["sync", "async", "colocated"],
        help="run only this variant (repeatable; no speedup without both sync and async)",
    )
    args = parser.parse_intermixed_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1 (got {args.repeats})")
    if args.measured_steps is None and (args.repeats > 1 or args.add_to):
        args.measured_steps = 20
    if args.measured_steps is not None and args.measured_steps < 1:
        parser.error(f"--measured-steps must be at least 1 (got {args.measured_steps})")
    return args


@dataclass
class Policy:
    """What every variant trains: its size and its mean prompt length."""

    params: int
    prompt_tokens: float
    overrides: list[str]  # point the variants at the model made once (none for a given model.path)
    active_params: int = 0  # a mixture of experts': the parameters one token uses (0: all, dense)


def setup_policy(cfg: RunConfig, run_root: Path) -> Policy:
    model_path, overrides = setup_model(cfg, run_root)
    hf = json.loads((model_path / "config.json").read_text())
    shape = ModelShape.from_hf_config(hf)
    if shape.moe:  # an MoE: MFU counts the FLOPs of the experts a token is routed to
        return Policy(shape.num_params, prompt_tokens_mean(cfg, model_path), overrides, shape.active_params)
    return Policy(decoder_param_count(hf), prompt_tokens_mean(cfg, model_path), overrides)


LAUNCH_RECORD = "benchmark_launch.json"  # in a variant's run directory: its `launch_s`, for a later `--reuse`


def finished(cfg: RunConfig) -> bool:
    """Whether `cfg.run_dir` holds a run that recorded all of its `trainer.total_steps` steps."""
    path = Path(cfg.run_dir) / "metrics.jsonl"
    return path.exists() and len(read_metrics(path)) >= cfg.trainer.total_steps


def run_variant(
    config: Path,
    overrides: list[str],
    args: argparse.Namespace,
    policy: Policy,
    *,
    reuse: bool = False,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Launch one variant (`env` added to its environment) and summarise its run; with
    `reuse`, a finished run is summarised without launching it again, and its `launch_s` is
    the one its launching invocation recorded in the run directory (None if none did)."""
    cfg = load_settled(config, overrides)
    run_dir = Path(cfg.run_dir)
    if reuse and finished(cfg):
        record = run_dir / LAUNCH_RECORD
        launched = json.loads(record.read_text()) if record.exists() else {}
        launch_s, peaks = launched.get("launch_s"), launched.get("gpu_process_peak_gb")
    else:
        with PeakSampler() as gpu:
            launch_s = launch(config, overrides, run_dir.with_suffix(".log"), args.timeout_s, env)
        peaks = gpu.rounded() or None
        (run_dir / LAUNCH_RECORD).write_text(json.dumps({"launch_s": launch_s, "gpu_process_peak_gb": peaks}) + "\n")
    records = read_metrics(run_dir / "metrics.jsonl")
    cooldown = min(cfg.rollout.max_staleness, max(0, len(records) - args.warmup_steps - 1))
    trainer_ranks = role_counts(cfg)["trainer"]
    summary = summarize_run(
        records,
        warmup=args.warmup_steps,
        cooldown=cooldown,
        params=policy.active_params or policy.params,
        policy_bytes=policy.params * BF16_BYTES,
        prompt_tokens=policy.prompt_tokens,
        peak_flops=args.peak_tflops * 1e12 * trainer_ranks,
    )
    memory = memory_figures(cfg, records)
    planned = memory.pop("plan_process_gb", {})
    return {
        **summary,
        **memory,
        **process_figures(peaks, planned),
        **step_time_figures(memory.get("plan_train_s"), summary),
        "cooldown_steps": cooldown,
        "launch_s": launch_s,
        "trainer_ranks": trainer_ranks,
    }


def memory_figures(cfg: RunConfig, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Trainer rank 0's measured allocator peak over the run (`cuda_peak_gb`, `cuda_reserved_gb`)
    and its process's resident high-water mark (`host_peak_gb`), each beside the launch-time
    memory plan's estimate (`plan_trainer_peak_gb`, `plan_trainer_host_gb`; runtime/memory/plan.py,
    on this machine's GPUs), the plan's GB per phase of the fullest GPU, and what `auto` chose for the
    run (`auto_chosen`: the run's RUN_DIR/config.yaml, which the plan is of)."""
    from runtime.memory.plan import launch_plan

    written = Path(cfg.run_dir) / "config.yaml"
    ran = load_settled(written) if written.exists() else cfg
    plan = launch_plan(ran, asks_gpus=True)
    out: dict[str, Any] = {
        "plan_trainer_peak_gb": plan.trainer_peak_gb(),
        "plan_gpu_gb": plan.gpu_gb,
        "plan_phases_gb": max((g.phases() for g in plan.gpus), key=lambda p: max(p.values()), default={}),
        "auto_chosen": ran.memory.chosen,
        "plan_train_s": plan.step.total_s if plan.step else None,
        "plan_train_s_parts": plan.step.parts if plan.step else None,
    }
    out["plan_trainer_host_gb"] = plan.trainer_host_gb()
    out["plan_process_gb"] = {name: round(gb, 2) for name, gb in plan.process_gb().items()}
    for key in ("cuda_peak_gb", "cuda_reserved_gb", "host_peak_gb"):
        seen = [r[key] for r in records if key in r]
        out[key] = max(seen) if seen else None
    if out["cuda_peak_gb"] and out["plan_trainer_peak_gb"]:
        out["plan_over_measured_peak"] = out["plan_trainer_peak_gb"] / out["cuda_peak_gb"]
    if out["host_peak_gb"] and out["plan_trainer_host_gb"]:
        out["plan_over_measured_host"] = out["plan_trainer_host_gb"] / out["host_peak_gb"]
    return out


def process_figures(peaks: dict[str, float] | None, planned: dict[str, float]) -> dict[str, Any]:
    """Each role's GPU memory as nvidia-smi saw it at its highest during the run
    (`gpu_process_peak_gb`, benchmarks/gpu_process_peaks.py; None without nvidia-smi) beside what
    the plan gave its process (`plan_process_gb`: its items, allocator slack and context), and
    their ratio per process (`process_over_plan`: above 1.0, the process outgrew its share)."""
    over = {n: round(gb / planned[n], 3) for n, gb in (peaks or {}).items() if planned.get(n)}
    return {"gpu_process_peak_gb": peaks, "plan_process_gb": planned, "process_over_plan": over or None}


def step_time_figures(plan_train_s: float | None, summary: dict[str, Any]) -> dict[str, Any]:
    """The trainer's measured training time per step over the steady window (`train_s_per_step`:
    training busy time / steps) beside the plan's estimate made before the run
    (`plan_train_s`, runtime/memory/step_time.py), and their ratio."""
    measured = summary["train_busy_s"] / summary["steps"] if summary.get("steps") else None
    ratio = plan_train_s / measured if plan_train_s and measured else None
    return {"train_s_per_step": measured, "plan_over_measured_train_s": ratio}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = Path(args.config).resolve()
    base = load_settled(config, args.overrides)
    stamp = f"{config.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_root = (args.run_root or ROOT / "runs" / "async_vs_sync" / stamp).resolve()
    run_root.mkdir(parents=True, exist_ok=True)
    if args.gpus:
        try:
            check_one_gpu(base, config.name)
        except ValueError as exc:
            raise SystemExit(f"async_vs_sync: {exc}") from None
    policy = setup_policy(base, run_root)
    measured_as = {
        "config": str(config.relative_to(ROOT) if config.is_relative_to(ROOT) else config),
        "overrides": args.overrides,
        "staleness": args.staleness,
        "warmup_steps": args.warmup_steps,
        "params": policy.params,
    }
    earlier = earlier_repeats(args, base, measured_as) if args.add_to else []

    def repeat_job(runs: dict[str, list[str]]) -> Job[dict[str, Any]]:
        return lambda env: {
            name: run_variant(config, overrides, args, policy, reuse=args.reuse, env=env)
            for name, overrides in runs.items()
        }

    # Alternating: every repeat runs each variant once, in order, on one GPU (--gpus: repeats side by side).
    jobs = [repeat_job(runs) for runs in plan_runs(config, base, args, policy, run_root, first=len(earlier))]
    where = provenance()
    new = [{"gpu": gpu, **where, "variants": r} for r, gpu in run_spread(jobs, args.gpus)]
    every = [*earlier, *new]
    repeats = [e["variants"] for e in every]
    rollout_bench = json.loads(args.rollout_bench.read_text()) if args.rollout_bench else None
    variants = repeats[0]
    extra: dict[str, Any] = {}
    if len(every) > 1:
        agg = aggregate_repeats(repeats)
        variants = agg["median_runs"]
        extra = {
            "repeats": [
                {
                    "repeat": i,
                    **{k: v for k, v in e.items() if k != "variants"},
                    **compare(e["variants"], None),
                    "variants": e["variants"],
                }
                for i, e in enumerate(every)
            ],
            "spread": agg["spread"],
            "measured_steps": args.measured_steps,
        }
    else:
        extra = where
    result = {
        "benchmark": "async_vs_sync",
        **measured_as,
        "policy_bytes_bf16": policy.params * BF16_BYTES,
        "prompt_tokens_mean": policy.prompt_tokens,
        "peak_tflops_per_gpu": args.peak_tflops,
        "run_root": str(run_root),
        "gpus": args.gpus,
        **compare(variants, rollout_bench),
        "variants": variants,
        **extra,
    }
    if "speedup" in extra.get("spread", {}):
        result["speedup"] = extra["spread"]["speedup"]["median"]
    emit(result, args.out)


def plan_runs(
    config: Path, base: RunConfig, args: argparse.Namespace, policy: Policy, run_root: Path, first: int = 0
) -> list[dict[str, list[str]]]:
    """Each repeat's overrides per variant, checked before any run starts (a bad variant
    fails at once). One repeat: run directories `RUN_ROOT/NAME`; more (or `first`, the number
    of earlier repeats, above 0): `RUN_ROOT/NAME-R`, R counted from `first`."""
    colocated = args.colocated_gpu_util if args.colocated else None
    out = []
    for rep in range(first, first + args.repeats):
        runs: dict[str, list[str]] = {}
        for name, extra in variant_overrides(base, args.staleness, colocated).items():
            if args.only and name not in args.only:
                continue
            tag = name if args.repeats == 1 and not first else f"{name}-{rep}"
            common = [*args.overrides, *policy.overrides, f"name={config.stem}-{tag}", f"run_dir={run_root / tag}"]
            steps = steps_override(
                load_settled(config, [*args.overrides, *extra]), args.warmup_steps, args.measured_steps
            )
            runs[name] = [*common, *extra, *steps]
            check_launch(load_settled(config, runs[name]))
        out.append(runs)
    return out


def earlier_repeats(args: argparse.Namespace, base: RunConfig, measured_as: dict[str, Any]) -> list[dict[str, Any]]:
    """The repeats of `args.add_to` (an earlier JSON of this benchmark), each with its
    `variants` and what it recorded of `gpu`, `measured_at`, `host` and `commit`; a file
    measured otherwise than this invocation (`measured_as`: config, overrides, staleness,
    warm-up, params; then its variants and measured steps) is refused, naming the first
    field that differs."""
    path: Path = args.add_to
    old = read_earlier(path, "async_vs_sync", "variants", measured_as)
    keep = ("gpu", "measured_at", "host", "commit")
    if "repeats" in old:
        found = [{**{k: r.get(k) for k in keep}, "variants": r["variants"]} for r in old["repeats"]]
    else:
        found = [{"gpu": old.get("gpus"), **{k: old.get(k) for k in keep[1:]}, "variants": old["variants"]}]
    colocated = args.colocated_gpu_util if args.colocated else None
    wanted = {n for n in variant_overrides(base, args.staleness, colocated) if not args.only or n in args.only}
    for i, rep in enumerate(found):
        if set(rep["variants"]) != wanted:
            raise SystemExit(
                f"async_vs_sync: --add-to {path}: repeat {i} ran {sorted(rep['variants'])}, now {sorted(wanted)}"
            )
        for name, run in rep["variants"].items():
            if run.get("steps") != args.measured_steps:
                raise SystemExit(
                    f"async_vs_sync: --add-to {path}: repeat {i}'s {name} run kept {run.get('steps')} "
                    f"measured steps, now {args.measured_steps} (--measured-steps)"
                )
    return found


def emit(result: dict[str, Any], out: Path | None) -> None:
    """Print `result` as one JSON line (floats rounded), and write it to `out` too."""
    print_json(rounded(result), out)


if __name__ == "__main__":
    main()
