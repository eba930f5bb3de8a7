"""Rollout role vs vLLM's fastest bare drive, and in-place weight-update time. Prints one JSON object.

In one run, on the same machine, like for like:

* baseline: vLLM's offline `LLM.generate` in this process with the engine core in-process
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as vLLM's own offline path runs fastest), every
  request of the batch at once, per-token logprobs on, the final output of each request only;
* role: the rollout role as its own process, driven over its ZeroMQ channel exactly as
  the controller drives it (`Generate` in, one `Completion` per sample out).

The bare engine gets the role's engine arguments (roles/generation/engine.py `engine_kwargs`;
the role's are read back from its `engine_args` log line) with `--bare-arg KEY=VALUE` on top
(to try other arguments on the bare side: the JSON's `engine_args` holds both sets and names
every argument that differs), the same prompts and vLLM `SamplingParams` (built by the role's
own function; the JSON's `sampling`) and the role's prefix-cache salt. The side that handles
the engine's outputs gets the role process's treatment:

* the launcher's role environment (runtime/launch/env.py): the script re-executes itself
  with it, since glibc reads its malloc tunables only when a process starts;
* the garbage collector's view frozen once set up (runtime/gc_pauses.py `settle`, as
  runtime/role.py does; `bench_gc_frozen` in the JSON).

Both engines are resident at once and their batches alternate (bare first, then role first,
and so on) after one warm-up batch each, so a drift of the machine lands on both sides.
Throughput is output tokens per second over the whole batch; `role_over_bare` is the ratio of
the two sides' medians over `--reps` repetitions, `role_over_bare_pairs` each repetition's
role / bare and `role_over_bare_pair_median` their median. `--update-every S` adds `--reps`
pairs of role batches, one plain and one with a whole-model weight update pushed every S
seconds while it generates (`role_updating_tokens_per_s`, `role_updating_over_bare`;
`role_updating_over_role`, the median of each pair's updating / plain, is the updates' cost
alone, free of drift). The update figure is the median time of a whole update of the model,
sent as the trainer sends it (buckets of `weight_sync.bucket_mb`, by the backend
`weight_sync.backend` picks for a trainer on GPU 0 beside the rollout: `ipc` on a GPU, `zmq`
on the CPU), from the first bucket packed to the `WeightsApplied` reply, with the phase split
and the role's own receive / load / total times.

`--seeded` adds a third side to the alternation: the bare engine again, every request with a
seed of its own as `rollout.seeded_sampling` gives it (vLLM then draws each seeded request's
noise one request at a time and skips FlashInfer's sampler); `seeded_over_bare` is the median
of each repetition's seeded / unseeded bare rate, the cost of the seeds alone. Both engines
then start as a seeded run's do (`rollout.seeded_sampling=true`: on a CPU, unchunked prefills).

    .venv/bin/python benchmarks/rollout.py [--prompts 64] [--max-tokens 128] [--reps 3] [--update-every 2]
        [--seeded] [--bare-arg KEY=VALUE ...] [--out FILE] [key=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# vLLM logs to stdout by default; stdout is for this benchmark's one JSON object.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
# The bare engine starts in this process; forked workers hang there on a GPU.
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

from benchmarks.json_out import print_json, provenance
from roles.controller.dispatch import group_seed
from runtime.config import RunConfig
from runtime.launch.env import ROLE_ENV_DEFAULTS
from runtime.logs import setup_logging
from runtime.memory.auto import load_settled


def gpu_present() -> bool:
    import torch

    return torch.cuda.is_available()


def run_in_role_environment() -> None:
    """Re-execute this script with the launcher's role defaults (runtime/launch/env.py)
    where the environment lacks them (a value already set wins): glibc reads
    GLIBC_TUNABLES, and OpenMP its thread count, only when a process starts, so setting
    them here would reach the engine's child processes but not this one, where the bare
    engine's outputs are handled."""
    env = {**ROLE_ENV_DEFAULTS, **os.environ}
    if env != dict(os.environ):
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def requests(num: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(prompt_len)] for _ in range(num)]


def bare_engine_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """The engine arguments the rollout role (rank 0) starts vLLM with under `cfg`."""
    from roles.generation.engine import engine_kwargs
    from roles.rollout.agents import serves_agents
    from runtime.config.placement import rollout_sleeps
    from runtime.identity.paths import model_dir

    sleeps, structured = rollout_sleeps(cfg, 0), serves_agents(cfg)
    return engine_kwargs(
        cfg.rollout.engine,
        str(model_dir(cfg)),
        sleep_mode=sleeps,
        structured_outputs=structured,
        seeded=cfg.rollout.seeded_sampling,
    )


def role_engine_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """The engine arguments the rollout role logged (`engine_args`, its last start)."""
    lines = (Path(cfg.run_dir) / "logs" / "rollout-0.jsonl").read_text().splitlines()
    found = [r["args"] for r in map(json.loads, lines) if r.get("event") == "engine_args"]
    if not found:
        raise SystemExit("rollout benchmark: the role logged no engine_args")
    return found[-1]


def differing_args(bare: dict[str, Any], role: dict[str, Any]) -> list[str]:
    """Every argument the two sets do not share with the same value, as `key: bare X vs role Y`."""

    def shown(args: dict[str, Any], key: str) -> str:
        return repr(args[key]) if key in args else "<unset>"

    keys = sorted(k for k in bare.keys() | role.keys() if k not in bare or k not in role or bare[k] != role[k])
    return [f"{k}: bare {shown(bare, k)} vs role {shown(role, k)}" for k in keys]


def bare_args(cfg: RunConfig, extra: list[str]) -> dict[str, Any]:
    """The role's engine arguments with `extra` (KEY=VALUE, values parsed as YAML) on top."""
    import yaml

    args = bare_engine_kwargs(cfg)
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"rollout benchmark: --bare-arg {item!r} is not KEY=VALUE")
        args[key] = yaml.safe_load(value)
    return args


def sampling_spec(max_tokens: int) -> Any:
    from transport import wire

    return wire.SamplingSpec(n=1, max_tokens=max_tokens, ignore_eos=True)


class BareLLM:
    """vLLM's offline `LLM` in this process, engine core in-process, with `args`, the
    role's prompts and sampling."""

    def __init__(self, cfg: RunConfig, args: dict[str, Any], max_tokens: int) -> None:
        from vllm import LLM

        from roles.generation.engine import _sampling_params

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.rollout.engine.cpu_kvcache_gb))
        self.llm: Any = LLM(**args)
        self.params = _sampling_params(sampling_spec(max_tokens), 0)
        self.seeded_spec = msgspec.structs.replace(sampling_spec(max_tokens), seed=group_seed(0, 0))
        self.salt = {"cache_salt": "v0"} if args.get("enable_prefix_caching") else {}  # the role salts

    async def batch(self, prompts: list[list[int]], tag: str, *, seeded: bool = False) -> float:
        """Output tokens per second of one `LLM.generate` call over `prompts` (`seeded`:
        request i with the seed of a seeded run's sample i of group 0)."""
        from roles.generation.engine import _sampling_params

        params = [_sampling_params(self.seeded_spec, i) for i in range(len(prompts))] if seeded else self.params
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p, **self.salt} for p in prompts], params, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return tokens / (time.perf_counter() - start)

    def shutdown(self) -> None:
        """Free the engine (its memory); a second call does nothing."""
        if self.llm is not None:
            import gc

            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            gc.collect()


async def interleaved(
    cfg: RunConfig,
    args: dict[str, Any],
    prompts: list[list[int]],
    max_tokens: int,
    reps: int,
    update_every: float,
    seeded: bool = False,
) -> tuple[list[float], list[float], list[float], str, dict]:
    """Both engines resident at once, their batches alternating (bare first in even
    repetitions, role first in odd ones; with `seeded`, the seeded bare batch between them)
    after one warm-up batch each, so drift of the machine (clocks, heat, a neighbour) lands on
    every side alike. Returns the bare, role and seeded bare rates per repetition (the last
    empty without `seeded`), the vLLM SamplingParams and the update figures (measured with
    the bare engine shut down)."""
    from runtime import gc_pauses
    from tests.helpers.harness import RoleHarness

    bare = BareLLM(cfg, args, max_tokens)
    harness = RoleHarness(cfg, "rollout")
    rates: dict[str, list[float]] = {"bare": [], "role": [], "seeded": []}
    try:
        await harness.start()
        frozen = gc_pauses.settle()  # as every role does once set up (runtime/role.py)
        for rep in range(reps + 1):
            sides = [("bare", bare.batch), ("role", lambda p, t: role_batch(harness, p, max_tokens, t))]
            if seeded:
                sides.insert(1, ("seeded", lambda p, t: bare.batch(p, t, seeded=True)))
            for name, run in sides if rep % 2 == 0 else sides[::-1]:
                rate = await run(prompts, f"{name}{rep}")
                if rep:  # rep 0 warms every side up
                    rates[name].append(rate)
        bare.shutdown()  # its memory back before the trainer side's copy of the model
        side, tensors, backend = await trainer_side(harness)
        update = {"update_backend": backend, **await weight_updates(side, tensors, harness, reps=5)}
        if update_every > 0:
            update.update(await role_updating(harness, side, tensors, prompts, max_tokens, reps, update_every))
        await side.aclose()
    finally:
        bare.shutdown()
        await harness.stop()
    return rates["bare"], rates["role"], rates["seeded"], repr(bare.params), {"bench_gc_frozen": frozen, **update}


async def role_batch(harness: Any, prompts: list[list[int]], max_tokens: int, tag: str) -> float:
    """Output tokens per second of one batch of `prompts` through the role."""
    from transport import wire

    spec = sampling_spec(max_tokens)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        await harness.send(wire.Generate(request_id=f"{tag}-{i}", group_id=i, prompt_ids=p, sampling=spec))
    tokens = 0
    for _ in prompts:
        tokens += (await harness.next(wire.Completion)).token_ids.numel()
    return tokens / (time.perf_counter() - start)


async def role_updating(
    harness: Any, side: Any, tensors: dict, prompts: list[list[int]], max_tokens: int, reps: int, every_s: float
) -> dict[str, Any]:
    """`reps` pairs of batches through the role, alternating: one plain, one while a
    whole-model update is pushed at once and then every `every_s` seconds until it ends
    (`updates_during`: how many were pushed), so machine drift lands on both alike and
    `role_updating_over_role` (the median of each pair's updating / plain) is the updates'
    cost alone."""
    pushed: list[float] = []
    version = 5  # weight_updates pushed 1..5; the role takes versions up to trainer.total_steps

    async def updater(stop: asyncio.Event) -> None:
        nonlocal version
        while True:  # the first update at once, then one every `every_s` until the batch ends
            version += 1
            result = await side.push(version, tensors)
            if result.failed:
                raise RuntimeError(str(next(iter(result.failed.values()))))
            pushed.append(result.seconds)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
                return

    plain: list[float] = []
    rates: list[float] = []
    for rep in range(reps):
        plain.append(await role_batch(harness, prompts, max_tokens, f"p{rep}"))
        stop = asyncio.Event()
        task = asyncio.create_task(updater(stop))
        try:
            rates.append(await role_batch(harness, prompts, max_tokens, f"u{rep}"))
        finally:
            stop.set()
            await task
    return {
        "update_every_s": every_s,
        "role_updating_tokens_per_s": statistics.median(rates),
        "role_updating_runs": rates,
        "role_plain_runs": plain,
        "updates_during": len(pushed),
        "role_updating_over_role": statistics.median(u / p for u, p in zip(rates, plain, strict=True)),
        "updating_update_s_median": statistics.median(pushed) if pushed else None,
    }


async def trainer_side(harness: Any) -> tuple[Any, dict, str]:
    """A connected trainer side (the backend a trainer on GPU 0 would pick) and the model's tensors."""
    import torch
    from safetensors.torch import load_file

    from roles.weights.backend import choose_backend
    from roles.weights.ipc import device_uuid
    from tests.helpers.weights import TrainerSide

    cfg = harness.cfg
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    uuid = device_uuid(device) if device.type == "cuda" else ""
    backend = choose_backend(cfg.weight_sync.backend, device, uuid, [harness.peer])
    tensors = {k: v.to(device) for k, v in load_file(Path(cfg.run_dir) / "model" / "model.safetensors").items()}
    side = TrainerSide(
        harness, backend, device, timeout_s=cfg.weight_sync.timeout_s, bucket_mb=cfg.weight_sync.bucket_mb
    )
    await side.connect()
    return side, tensors, backend


async def weight_updates(side: Any, tensors: dict, harness: Any, reps: int) -> dict:
    cfg = harness.cfg
    times, applied, phases = [], [], []
    for version in range(1, reps + 1):
        result = await side.push(version, tensors)
        if result.failed:
            raise RuntimeError(str(next(iter(result.failed.values()))))
        times.append(result.seconds)
        applied.append(result.applied[f"{harness.role}-{harness.rank}"])
        phases.append(result.phases)
    return {
        "update_bucket_mb": cfg.weight_sync.bucket_mb,
        "update_s_median": statistics.median(times),
        "update_s_max": max(times),
        "update_phases_s_median": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
        "role_receive_s_median": statistics.median(a.receive_s for a in applied),
        "role_load_s_median": statistics.median(a.load_s for a in applied),
        "role_total_s_median": statistics.median(a.total_s for a in applied),
        "update_mb": applied[0].num_bytes / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--update-every",
        type=float,
        default=0.0,
        help="also run the role with a weight update every this many seconds (0: no)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer, shorter requests (smoke test)")
    parser.add_argument(
        "--seeded", action="store_true", help="also time the bare engine with a seed per request (seeded_over_bare)"
    )
    parser.add_argument("--config", default="configs/tiny_cpu.yaml", help="recipe whose model and engine to use")
    parser.add_argument(
        "--bare-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine argument of the bare LLM on top of the role's (repeatable)",
    )
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (e.g. for a GPU)")
    args = parser.parse_args()
    run_in_role_environment()
    if args.quick:
        args.prompts, args.max_tokens, args.reps = 16, 16, 2  # both orders of the alternation
    # The engine must hold prompt + response; requests that cannot fit would only measure errors.
    fit = f"rollout.engine.max_model_len={max(256, args.prompt_len + args.max_tokens + 1)}"
    # Every update is a new policy version; the role refuses one past the run's last step.
    many = "trainer.total_steps=1000000"
    # --seeded: both engines start as a seeded run's do (on a CPU: prefills unchunked).
    fixed = ["rollout.engine.max_num_seqs=256", fit, many, *(["rollout.seeded_sampling=true"] if args.seeded else [])]
    cfg = load_settled(args.config, [*fixed, *args.overrides])
    share = cfg.rollout.engine.gpu_memory_utilization
    if 2 * share > 0.95 and gpu_present():
        parser.error(
            f"rollout.engine.gpu_memory_utilization is {share}: the bare engine and the role's are resident "
            "at once on GPU 0, so each may take at most 0.47 (e.g. rollout.engine.gpu_memory_utilization=0.45)"
        )
    run_dir = Path(tempfile.mkdtemp(prefix="tandem-bench-rollout-"))  # after the refusal: none left behind
    cfg = load_settled(args.config, [f"run_dir={run_dir}", *fixed, *args.overrides])
    setup_logging(None, "bench", level="warning")  # stderr: stdout carries only the JSON
    from runtime.launch.launcher import prepare_run_dir

    prepare_run_dir(cfg)
    prompts = requests(args.prompts, args.prompt_len)
    args_bare = bare_args(cfg, args.bare_arg)
    # vLLM's offline LLM runs its engine core in the calling process only with this set: its
    # fastest drive, the baseline (the role's engine core is in its process whatever it says).
    # Set here, just before the engines, not at import: a test importing this module must not
    # change how every vLLM engine of its process runs (on a CPU the workers would move in too).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    base, ours, seeded, params, update = uvloop.run(
        interleaved(cfg, args_bare, prompts, args.max_tokens, args.reps, args.update_every, args.seeded)
    )
    args_role = role_engine_kwargs(cfg)
    differ = differing_args(args_bare, args_role)
    print(json.dumps({"engine_args": {"bare": args_bare, "role": args_role, "differ": differ}}), file=sys.stderr)
    bare_rate = statistics.median(base)
    result = {
        "benchmark": "rollout",
        "requests": args.prompts,
        "max_tokens": args.max_tokens,
        "bare_vllm_tokens_per_s": bare_rate,
        "role_tokens_per_s": statistics.median(ours),
        "role_over_bare": statistics.median(ours) / bare_rate,
        "role_over_bare_pairs": [r / b for b, r in zip(base, ours, strict=True)],
        "role_over_bare_pair_median": statistics.median(r / b for b, r in zip(base, ours, strict=True)),
        "bare_runs": base,
        "role_runs": ours,
        "engine_args": {"bare": args_bare, "role": args_role, "differ": differ},
        "bare_drive": "vllm.LLM.generate, engine core in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)",
        "sampling": {"spec": msgspec.to_builtins(sampling_spec(args.max_tokens)), "vllm": params},
        "env": {k: os.environ[k] for k in ROLE_ENV_DEFAULTS},
        **update,
        **provenance(),
    }
    if seeded:
        result["bare_seeded_tokens_per_s"] = statistics.median(seeded)
        result["bare_seeded_runs"] = seeded
        result["seeded_over_bare"] = statistics.median(x / b for b, x in zip(base, seeded, strict=True))
    if "role_updating_tokens_per_s" in update:
        result["role_updating_over_bare"] = update["role_updating_tokens_per_s"] / bare_rate
    print_json(result, args.out)


if __name__ == "__main__":
    main()
