"""Transport benchmark: the roles' request path (RpcEndpoint) vs pickle over raw zmq sockets.

Run: `.venv/bin/python benchmarks/transport.py [--quick] [--latency-only]`; prints ONE JSON
object on stdout.

Two processes, both on uvloop, over `ipc://` (a temp dir) and `tcp://127.0.0.1`: this one
sends, a `spawn`ed peer serves: a fresh one for each throughput size and for the latency
rows (with `--quick`, one for everything). The peer starts with the environment the
launcher gives every role (`runtime/launch/env.py`; variables already set win, as in
the launcher). Every row is a sequence of round trips, one at a time: a request, then
its answer.

* throughput — a weight update as the trainer sends it: each request is a
  `WeightBucket` of 4 named bf16 tensors (1/16/64 MiB in all), sent with
  `RpcEndpoint.request` from a `connect_dealer` client to the peer's `bind_router`
  server, whose handler (a task, as in the runtime) decodes it (`torch.frombuffer` over
  the received frames), reads one element of each tensor and answers `Ack`.
  - `zero_copy_mib_s`: that path (header + msgpack payload + one zero-copy frame per
    tensor, `send_multipart(copy=False)`).
  - `pickle_mib_s` (baseline): `pickle.dumps({"version", "index", "last", "tensors"},
    protocol=5)` as one frame over raw zmq.asyncio DEALER/ROUTER sockets (`copy=False`
    both ways, so only the serialisation differs); the peer `pickle.loads` it, reads one
    element of each tensor and answers with a pickled ack.
  One rep = `msgs_per_rep` buckets, timed from the first send to the last answer; MiB/s
  is the median over reps after one warm-up rep, `zero_copy_over_pickle` the ratio of
  the medians. `throughput_64MiB_by_receiver_malloc` repeats the 64 MiB rows with other
  glibc malloc settings for the peer (`RECEIVER_MALLOC`; not run with `--quick`).
* latency — the controller's small request: a `Generate` (a 128-token prompt, n=8)
  answered with `Ack`, p50/p90/p99 in µs after a warm-up:
  - `rpc`: `RpcEndpoint.request` from a `connect_dealer` client to a `bind_router`
    server whose handler (a task) answers; both sides decode.
  - `pickle_raw_zmq` (baseline): the same request as a pickled dict over raw zmq.asyncio
    DEALER/ROUTER sockets on uvloop, answered inline with a pickled dict.
  - `pickle_sync_zmq` (floor): the same over blocking zmq sockets, no event loop at all.
  `client_cpu_us` / `server_cpu_us` are process CPU seconds per round trip (zmq's I/O
  thread included), steadier than wall-clock percentiles on a shared machine.

Numbers on a shared 2-core machine are noisy; compare rows of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import uvloop
import zmq
import zmq.asyncio

from benchmarks.json_out import provenance
from runtime.launch.env import ROLE_ENV_DEFAULTS
from runtime.logs import setup_logging
from transport import wire
from transport.endpoint import Envelope
from transport.sockets import bind_router, connect_dealer

MiB = 1 << 20
SIZES_MIB = (1, 16, 64)
TENSORS_PER_BUCKET = 4
PROMPT_IDS = list(range(1000, 1128))
SAMPLING = wire.SamplingSpec(n=8, temperature=1.0, max_tokens=32)
TIMEOUT_S = 30.0

# Each row's client: (address, number of round trips) -> (seconds of each, client CPU seconds).
Client = Callable[[str, int], Coroutine[Any, Any, tuple[list[float], float]]]


# --- what travels ----------------------------------------------------------------------


def bucket_tensors(size_mib: int) -> dict[str, torch.Tensor]:
    """`size_mib` MiB of bf16 weights as named tensors, as the trainer buckets them."""
    rows = size_mib * MiB // TENSORS_PER_BUCKET // 2 // 1024
    return {
        f"model.layers.{k}.mlp.down_proj.weight": torch.randn(rows, 1024, dtype=torch.bfloat16)
        for k in range(TENSORS_PER_BUCKET)
    }


def weight_bucket(i: int, tensors: dict[str, torch.Tensor]) -> wire.WeightBucket:
    return wire.WeightBucket(version=1, index=i, last=False, tensors=tensors)


def pickled_bucket(i: int, tensors: dict[str, torch.Tensor]) -> bytes:
    return pickle.dumps({"version": 1, "index": i, "last": False, "tensors": tensors}, protocol=5)


def generate(i: int) -> wire.Generate:
    return wire.Generate(request_id=f"bench-{i}", group_id=i, prompt_ids=PROMPT_IDS, sampling=SAMPLING)


def pickled_generate(i: int) -> bytes:
    sampling = {"n": SAMPLING.n, "temperature": SAMPLING.temperature, "max_tokens": SAMPLING.max_tokens}
    return pickle.dumps({"request_id": f"bench-{i}", "group_id": i, "prompt_ids": PROMPT_IDS, "sampling": sampling})


def touch(tensors: dict[str, torch.Tensor]) -> float:
    """Read one element of each tensor, as a receiver that uses them would."""
    return sum(float(t[-1, -1]) for t in tensors.values())


# --- peer process (the server) -----------------------------------------------------------


def peer_main(conn: Connection) -> None:
    """Serve one experiment per command from `conn` until told to stop."""
    torch.set_num_threads(1)
    setup_logging(None, "bench-peer", level="warning")  # stderr: stdout carries only the JSON
    while True:
        cmd = conn.recv()
        if cmd is None:
            return
        kind, transport, tmp = cmd
        address = f"ipc://{tmp}/{kind}" if transport == "ipc" else "tcp://127.0.0.1:0"
        if kind == "pickle_sync":
            serve_pickle_sync(conn, address)
        else:
            uvloop.run(PEER_SERVERS[kind](conn, address))


async def serve_rpc(conn: Connection, address: str) -> None:
    """A `bind_router` server: buckets are read and acknowledged, generate requests acknowledged."""
    ctx = zmq.asyncio.Context()
    server = bind_router(ctx, address, name="bench-server")
    stop = asyncio.Event()

    async def handle(env: Envelope) -> wire.Message | None:
        if isinstance(env.msg, wire.WeightBucket):
            return wire.Ack(info=str(touch(env.msg.tensors)))
        if isinstance(env.msg, wire.Shutdown):
            stop.set()
        return wire.Ack()

    server.start(handle)
    conn.send(server.address)
    cpu0 = time.process_time()
    await stop.wait()
    cpu = time.process_time() - cpu0
    await asyncio.sleep(0.05)  # let the last Ack leave
    await server.aclose()
    conn.send({"server_cpu_s": cpu, "dropped": dict(server.stats.dropped)})
    ctx.term()


async def serve_pickle(conn: Connection, address: str) -> None:
    """Raw zmq.asyncio ROUTER: unpickle, read any tensors, answer with a pickled ack."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    conn.send(_bind_raw(sock, address))
    cpu0 = time.process_time()
    while True:
        peer, frame = await sock.recv_multipart(copy=False)
        obj = pickle.loads(frame.buffer)
        info = str(touch(obj["tensors"])) if "tensors" in obj else ""
        await sock.send_multipart([peer, pickle.dumps({"info": info})])
        if obj.get("stop"):
            break
    conn.send({"server_cpu_s": time.process_time() - cpu0, "dropped": {}})
    sock.close(linger=1000)
    ctx.term()


def serve_pickle_sync(conn: Connection, address: str) -> None:
    """The floor's server: blocking sockets, no event loop."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    conn.send(_bind_raw(sock, address))
    cpu0 = time.process_time()
    while True:
        peer, payload = sock.recv_multipart()
        obj = pickle.loads(payload)
        sock.send_multipart([peer, pickle.dumps({"info": ""})])
        if obj.get("stop"):
            break
    conn.send({"server_cpu_s": time.process_time() - cpu0, "dropped": {}})
    sock.close(linger=1000)
    ctx.term()


PEER_SERVERS = {"rpc": serve_rpc, "pickle": serve_pickle}


def _bind_raw(sock: zmq.Socket[Any], address: str) -> str:
    sock.bind(address.replace(":0", ":*"))
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


# --- measuring side (the client) ---------------------------------------------------------


def rpc_client(message: Callable[[int], wire.Message]) -> Client:
    """Round trips of `message(i)` through `RpcEndpoint.request`."""

    async def run(address: str, n: int) -> tuple[list[float], float]:
        ctx = zmq.asyncio.Context()
        client = connect_dealer(ctx, address, name="bench-client", identity="bench-client")
        client.start()
        seconds = []
        cpu0 = time.process_time()
        for i in range(n):
            t0 = time.perf_counter()
            reply = await client.request(message(i), timeout=TIMEOUT_S)
            seconds.append(time.perf_counter() - t0)
            assert isinstance(reply, wire.Ack)
        cpu = time.process_time() - cpu0
        await client.request(wire.Shutdown(reason="done"), timeout=TIMEOUT_S)
        await client.aclose()
        ctx.term()
        return seconds, cpu

    return run


def pickle_client(payload: Callable[[int], bytes]) -> Client:
    """Round trips of `payload(i)` (pickled) over a raw zmq.asyncio DEALER."""

    async def run(address: str, n: int) -> tuple[list[float], float]:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(address)
        seconds = []
        cpu0 = time.process_time()
        for i in range(n):
            t0 = time.perf_counter()
            await sock.send(payload(i), copy=False)
            pickle.loads(await sock.recv())
            seconds.append(time.perf_counter() - t0)
        cpu = time.process_time() - cpu0
        await sock.send(pickle.dumps({"stop": True}))
        await sock.recv()
        sock.close(linger=0)
        ctx.term()
        return seconds, cpu

    return run


def pickle_sync_client(address: str, n: int) -> tuple[list[float], float]:
    """The floor's client: blocking sockets, no event loop."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    seconds = []
    cpu0 = time.process_time()
    for i in range(n):
        t0 = time.perf_counter()
        sock.send(pickled_generate(i))
        pickle.loads(sock.recv())
        seconds.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu0
    sock.send(pickle.dumps({"stop": True}))
    sock.recv()
    sock.close(linger=0)
    ctx.term()
    return seconds, cpu


class Peer:
    """The spawned serving process and the control pipe to it (not on the measured path)."""

    def __init__(self, tmp: str, env: dict[str, str]) -> None:
        self.tmp = tmp
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=peer_main, args=(child,), daemon=True)
        saved = dict(os.environ)
        os.environ.update(env)  # a spawned child takes the environment of this moment
        try:
            self.proc.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def run(self, server: str, transport: str, client: Client | None, n: int) -> tuple[list[float], float, float]:
        """`n` round trips of `client` against a fresh `server`: the seconds of each, the
        client's and the server's CPU seconds. `client` None: the blocking floor."""
        self.conn.send((server, transport, self.tmp))
        address = self.conn.recv()
        seconds, cpu = pickle_sync_client(address, n) if client is None else uvloop.run(client(address, n))
        report = self.conn.recv()
        if report["dropped"]:
            raise RuntimeError(f"{server}/{transport}: the server dropped messages {report['dropped']}")
        return seconds, cpu, report["server_cpu_s"]

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(10)


@contextlib.contextmanager
def serving(tmp: str, env: dict[str, str], shared: Peer | None) -> Iterator[Peer]:
    """`shared` if given, else a fresh peer process, closed afterwards."""
    if shared is not None:
        yield shared
        return
    peer = Peer(tmp, env)
    try:
        yield peer
    finally:
        peer.close()


def measure_throughput(peer: Peer, transport: str, size_mib: int, reps: int, quick: bool) -> dict[str, Any]:
    tensors = bucket_tensors(size_mib)
    count = 2 if quick else max(4, min(32, 128 // size_mib))
    result: dict[str, Any] = {"msgs_per_rep": count, "reps": reps}
    paths: dict[str, tuple[str, Client]] = {
        "zero_copy": ("rpc", rpc_client(lambda i: weight_bucket(i, tensors))),
        "pickle": ("pickle", pickle_client(lambda i: pickled_bucket(i, tensors))),
    }
    for mode, (server, client) in paths.items():
        seconds, _, _ = peer.run(server, transport, client, (reps + 1) * count)
        rep_seconds = [sum(seconds[r * count : (r + 1) * count]) for r in range(1, reps + 1)]  # rep 0: warm-up
        result[f"{mode}_mib_s"] = round(statistics.median(count * size_mib / s for s in rep_seconds), 1)
    result["zero_copy_over_pickle"] = round(result["zero_copy_mib_s"] / result["pickle_mib_s"], 2)
    return result


def measure_latency(peer: Peer, transport: str, n: int, warmup: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    paths: dict[str, tuple[str, Client | None]] = {
        "rpc": ("rpc", rpc_client(generate)),
        "pickle_raw_zmq": ("pickle", pickle_client(pickled_generate)),
        "pickle_sync_zmq": ("pickle_sync", None),
    }
    for mode, (server, client) in paths.items():
        seconds, cpu, server_cpu = peer.run(server, transport, client, warmup + n)
        out[mode] = _percentiles([s * 1e6 for s in seconds[warmup:]])
        out[mode]["client_cpu_us"] = round(cpu / (n + warmup) * 1e6, 1)
        out[mode]["server_cpu_us"] = round(server_cpu / (n + warmup) * 1e6, 1)
    out["p50_rpc_over_pickle"] = round(out["rpc"]["p50_us"] / out["pickle_raw_zmq"]["p50_us"], 2)
    return out


# glibc settings for the serving process (GLIBC_TUNABLES is read at process start).
RECEIVER_MALLOC = {
    "default": "",
    "hugetlb": "glibc.malloc.hugetlb=1",
    "role": ROLE_ENV_DEFAULTS["GLIBC_TUNABLES"],
    "heap_no_mmap": "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296",
}


def measure_tuned_receiver(tmp: str, role_env: dict[str, str], reps: int) -> dict[str, Any]:
    """64 MiB again, with the serving process's allocator set otherwise (same for both paths).

    libzmq allocates every incoming message; above glibc's 32 MiB mmap ceiling each one is
    a fresh mapping whose every 4 KiB page faults on first write. `hugetlb` backs malloc
    with transparent huge pages; `heap_no_mmap` serves large blocks from one heap that is
    never trimmed, so the pages of one message are reused by the next; `role` (what the
    launcher gives every role) is the same with a 1 GiB trim threshold.
    """
    out: dict[str, Any] = {}
    for name, tunables in RECEIVER_MALLOC.items():
        with serving(tmp, {**role_env, "GLIBC_TUNABLES": tunables}, None) as peer:
            out[name] = {t: measure_throughput(peer, t, 64, reps, quick=False) for t in ("ipc", "tcp")}
    return out


def _percentiles(samples_us: list[float]) -> dict[str, Any]:
    qs = statistics.quantiles(samples_us, n=100, method="inclusive")
    return {
        "n": len(samples_us),
        "p50_us": round(statistics.median(samples_us), 1),
        "p90_us": round(qs[89], 1),
        "p99_us": round(qs[98], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions: a smoke test, not a measurement")
    parser.add_argument("--latency-only", action="store_true", help="only the round-trip latency rows")
    args = parser.parse_args()
    setup_logging(None, "bench", level="warning")  # stderr: stdout carries only the JSON
    reps, n_rtt, warmup = (1, 200, 50) if args.quick else (9, 2000, 300)
    torch.set_num_threads(1)
    started = time.time()
    load_before = os.getloadavg()[0]
    role_env = {k: v for k, v in ROLE_ENV_DEFAULTS.items() if k not in os.environ}  # as the launcher does
    throughput: dict[str, Any] = {}
    latency: dict[str, Any] = {}
    tuned: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        # A smoke test needs no fresh server process per row: one serves them all.
        with serving(tmp, role_env, None) if args.quick else contextlib.nullcontext() as shared:
            for transport in ("ipc", "tcp"):
                throughput[transport] = {}
                for size in () if args.latency_only else SIZES_MIB:
                    # A fresh server per size, as a rollout receiving weight buckets would be.
                    with serving(tmp, role_env, shared) as peer:
                        row = measure_throughput(peer, transport, size, reps, args.quick)
                    throughput[transport][f"{size}MiB"] = row
                with serving(tmp, role_env, shared) as peer:
                    latency[transport] = measure_latency(peer, transport, n_rtt, warmup)
        if not (args.quick or args.latency_only):
            tuned = measure_tuned_receiver(tmp, role_env, reps)
    targets = {"ipc_rtt_p50_under_200us": latency["ipc"]["rpc"]["p50_us"] < 200.0}
    if not args.latency_only:
        targets["ipc_64MiB_zero_copy_over_pickle_ge_3"] = throughput["ipc"]["64MiB"]["zero_copy_over_pickle"] >= 3.0
    result = {
        "benchmark": "transport",
        "quick": args.quick,
        "machine": _machine(),
        "receiver_glibc_tunables": {**os.environ, **role_env}.get("GLIBC_TUNABLES", ""),
        "throughput_mib_s": throughput,
        "latency_us": latency,
        **({"throughput_64MiB_by_receiver_malloc": tuned} if tuned else {}),
        "targets": targets,
        "seconds": round(time.time() - started, 1),
        "loadavg_1min": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        **provenance(),
    }
    print(json.dumps(result))


def _machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "uvloop": uvloop.__version__,
    }


if __name__ == "__main__":
    main()
