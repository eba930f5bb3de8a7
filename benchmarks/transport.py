"""Transport benchmark: zero-copy channel path vs pickle over the same zmq sockets.

Run: `.venv/bin/python benchmarks/transport.py [--quick] [--latency-only]`; prints ONE JSON
object on stdout.

Two processes (this one and a `spawn`ed peer), both on uvloop, over `ipc://` (a temp dir)
and `tcp://127.0.0.1`. Our channels are what the runtime uses (fan-out sockets on
zmq.asyncio; `RpcEndpoint` driving its socket from the descriptor); the baselines use
zmq.asyncio sockets directly:

* throughput — `TensorBatch(tensors={"x": float32 tensor of 1/16/64 MiB})` sent by this
  process through `connect_socket(PUSH)` (our codec: header + msgpack payload + one
  zero-copy tensor frame, `send_multipart(copy=False)`) to the peer's `bind_socket(PULL)`,
  which decodes every message (`torch.frombuffer` over the received frame) and reads one
  element. Baseline: `pickle.dumps({"seq": i, "x": tensor}, protocol=5)` sent as one frame
  over raw PUSH/PULL sockets (also `copy=False` both ways, so the baseline gets the same
  zero-copy socket path and only the serialisation differs); the peer `pickle.loads` it
  and reads one element. One rep = a burst of messages timed from the first send to the
  peer's acknowledgement of the last one; MiB/s is the median over reps, and
  `zero_copy_over_pickle` is the ratio of the medians. `throughput_64MiB_by_receiver_malloc`
  repeats the 64 MiB rows with the receiving process's glibc malloc tuned through
  `GLIBC_TUNABLES` (see `RECEIVER_MALLOC`): libzmq's per-message allocations above glibc's
  32 MiB mmap ceiling otherwise fault in every 4 KiB page. Not run with `--quick`.
* latency — sequential round trips of a small message after a warm-up, p50/p90/p99 in µs:
  - `channel`: `RpcEndpoint.request(TensorBatch(seq=i, meta={"x": [4 floats]}))` from a
    `connect_dealer` client to a `bind_router` server whose handler (run as a task, as
    in the runtime) echoes the message back; both sides decode. Same payload as the
    pickle baseline; the acceptance target (p50 < 200 µs on ipc) is read off this row.
  - `channel_tensor`: the same with the 4 floats as a tensor (`tensors={"x": ...}`),
    which the client materialises and reads.
  - `pickle_raw_zmq` (baseline): the pickled dict `{"seq": i, "x": [4 floats]}` over raw
    zmq.asyncio DEALER/ROUTER sockets on uvloop with an inline echo loop.
  - `pickle_sync_zmq` (floor): the same over blocking zmq sockets, no event loop at all.
  `client_cpu_us` / `server_cpu_us` are process CPU seconds per round trip (zmq's I/O
  thread included), steadier than wall-clock percentiles on a shared machine.

Numbers on a shared 2-core machine are noisy; compare medians from the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import uvloop
import zmq
import zmq.asyncio

from runtime.launcher_env import ROLE_MALLOC_TUNABLES
from runtime.logs import setup_logging
from transport import wire
from transport.channels import ChannelOptions, Envelope, bind_router, bind_socket, connect_dealer, connect_socket

MiB = 1 << 20
SIZES_MIB = (1, 16, 64)
LATENCY_PAYLOAD = [0.0, 1.0, 2.0, 3.0]
NO_POLL = ChannelOptions(busy_poll_us=0)  # the `channel_no_busy_poll` row


# --- peer process (receiver / echo server) -----------------------------------------------


def peer_main(conn: Connection) -> None:
    """Serve one experiment per command from `conn` until told to stop."""
    torch.set_num_threads(1)
    setup_logging(None, "bench-peer", level="warning")  # stderr: stdout carries only the JSON
    while True:
        cmd = conn.recv()
        if cmd is None:
            return
        kind, transport, params = cmd
        if kind == "latency_pickle_sync":
            peer_latency_pickle_sync(conn, transport, params)
        else:
            uvloop.run(PEER_EXPERIMENTS[kind](conn, transport, params))


def _address(transport: str, tmp: str, name: str) -> str:
    return f"ipc://{tmp}/{name}" if transport == "ipc" else "tcp://127.0.0.1:0"


async def peer_throughput_channel(conn: Connection, transport: str, p: dict[str, Any]) -> None:
    ctx = zmq.asyncio.Context()
    data = bind_socket(ctx, zmq.PULL, _address(transport, p["tmp"], "data"), name="bench-pull")
    ack = bind_socket(ctx, zmq.PUSH, _address(transport, p["tmp"], "ack"), name="bench-ack")
    conn.send((data.address, ack.address))
    for _ in range(p["bursts"]):
        touched = 0.0
        for _ in range(p["count"]):
            env = await data.recv()
            touched += float(env.msg.tensors["x"][-1])
        await ack.send(wire.Ack(info=str(touched)))
    conn.send(dict(data.stats.dropped))
    data.close()
    ack.close()
    ctx.term()


async def peer_throughput_pickle(conn: Connection, transport: str, p: dict[str, Any]) -> None:
    ctx = zmq.asyncio.Context()
    data, ack = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    conn.send((_bind_raw(data, transport, p["tmp"], "pdata"), _bind_raw(ack, transport, p["tmp"], "pack")))
    for _ in range(p["bursts"]):
        touched = 0.0
        for _ in range(p["count"]):
            frame = await data.recv(copy=False)
            obj = pickle.loads(frame.buffer)
            touched += float(obj["x"][-1])
        await ack.send(str(touched).encode())
    conn.send({})
    data.close(linger=0)
    ack.close(linger=1000)
    ctx.term()


async def peer_latency_channel(conn: Connection, transport: str, p: dict[str, Any]) -> None:
    ctx = zmq.asyncio.Context()
    server = bind_router(ctx, _address(transport, p["tmp"], "rpc"), name="bench-server")
    stop = asyncio.Event()
    cpu0 = time.process_time()

    async def echo(env: Envelope) -> wire.Message | None:
        if isinstance(env.msg, wire.Shutdown):
            stop.set()
            return wire.Ack()
        return env.msg

    server.start(echo)
    conn.send(server.address)
    await stop.wait()
    cpu = time.process_time() - cpu0
    await asyncio.sleep(0.05)  # let the Ack leave
    await server.aclose()
    conn.send({"server_cpu_s": cpu})
    ctx.term()


async def peer_latency_pickle(conn: Connection, transport: str, p: dict[str, Any]) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    conn.send(_bind_raw(sock, transport, p["tmp"], "prpc"))
    cpu0 = time.process_time()
    while True:
        peer, payload = await sock.recv_multipart()
        obj = pickle.loads(payload)
        await sock.send_multipart([peer, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)])
        if obj.get("stop"):
            break
    conn.send({"server_cpu_s": time.process_time() - cpu0})
    sock.close(linger=1000)
    ctx.term()


PEER_EXPERIMENTS = {
    "throughput_channel": peer_throughput_channel,
    "throughput_pickle": peer_throughput_pickle,
    "latency_channel": peer_latency_channel,
    "latency_pickle": peer_latency_pickle,
}


def _bind_raw(sock: zmq.asyncio.Socket, transport: str, tmp: str, name: str) -> str:
    if transport == "ipc":
        sock.bind(f"ipc://{tmp}/{name}")
    else:
        sock.bind("tcp://127.0.0.1:*")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


# --- measuring side -------------------------------------------------------------------


async def throughput_channel(addrs: tuple[str, str], tensor: torch.Tensor, count: int, bursts: int) -> list[float]:
    ctx = zmq.asyncio.Context()
    data = connect_socket(ctx, zmq.PUSH, addrs[0], name="bench-push")
    ack = connect_socket(ctx, zmq.PULL, addrs[1], name="bench-ack")
    seconds = []
    for _ in range(bursts):
        t0 = time.perf_counter()
        for i in range(count):
            await data.send(wire.TensorBatch(seq=i, tensors={"x": tensor}))
        await ack.recv()
        seconds.append(time.perf_counter() - t0)
    data.close()
    ack.close()
    ctx.term()
    return seconds


async def throughput_pickle(addrs: tuple[str, str], tensor: torch.Tensor, count: int, bursts: int) -> list[float]:
    ctx = zmq.asyncio.Context()
    data, ack = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    data.connect(addrs[0])
    ack.connect(addrs[1])
    seconds = []
    for _ in range(bursts):
        t0 = time.perf_counter()
        for i in range(count):
            await data.send(pickle.dumps({"seq": i, "x": tensor}, protocol=pickle.HIGHEST_PROTOCOL), copy=False)
        await ack.recv()
        seconds.append(time.perf_counter() - t0)
    data.close(linger=1000)
    ack.close(linger=0)
    ctx.term()
    return seconds


async def latency_channel(
    address: str, n: int, warmup: int, tensor: bool, options: ChannelOptions = ChannelOptions()
) -> tuple[list[float], float, dict[str, int]]:
    ctx = zmq.asyncio.Context()
    client = connect_dealer(ctx, address, name="bench-client", identity="bench-client", options=options)
    client.start(None)
    x = torch.tensor(LATENCY_PAYLOAD)
    samples = []
    cpu0 = time.process_time()
    for i in range(warmup + n):
        t0 = time.perf_counter_ns()
        if tensor:
            reply = await client.request(wire.TensorBatch(seq=i, tensors={"x": x}), timeout=5.0)
            float(reply.tensors["x"][-1])  # type: ignore[union-attr]
        else:
            reply = await client.request(wire.TensorBatch(seq=i, meta={"x": LATENCY_PAYLOAD}), timeout=5.0)
            float(reply.meta["x"][-1])  # type: ignore[union-attr]
        samples.append(time.perf_counter_ns() - t0)
    cpu = time.process_time() - cpu0
    await client.request(wire.Shutdown(reason="done"), timeout=5.0)
    polls = {"polled": client.stats.polled, "poll_misses": client.stats.poll_misses}
    await client.aclose()
    ctx.term()
    return [s / 1000 for s in samples[warmup:]], cpu, polls


async def latency_pickle(address: str, n: int, warmup: int) -> tuple[list[float], float, dict[str, int]]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    samples = []
    cpu0 = time.process_time()
    for i in range(warmup + n + 1):
        stop = i == warmup + n
        t0 = time.perf_counter_ns()
        await sock.send(pickle.dumps({"seq": i, "x": LATENCY_PAYLOAD, "stop": stop}, protocol=pickle.HIGHEST_PROTOCOL))
        obj = pickle.loads(await sock.recv())
        float(obj["x"][-1])
        samples.append(time.perf_counter_ns() - t0)
    cpu = time.process_time() - cpu0
    sock.close(linger=0)
    ctx.term()
    return [s / 1000 for s in samples[warmup : warmup + n]], cpu, {}


def latency_pickle_sync(address: str, n: int, warmup: int) -> tuple[list[float], float, dict[str, int]]:
    """The floor: blocking zmq sockets on both sides, no event loop at all."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    samples = []
    cpu0 = time.process_time()
    for i in range(warmup + n + 1):
        t0 = time.perf_counter_ns()
        sock.send(pickle.dumps({"seq": i, "x": LATENCY_PAYLOAD, "stop": i == warmup + n}, protocol=5))
        float(pickle.loads(sock.recv())["x"][-1])
        samples.append(time.perf_counter_ns() - t0)
    cpu = time.process_time() - cpu0
    sock.close(linger=0)
    ctx.term()
    return [s / 1000 for s in samples[warmup : warmup + n]], cpu, {}


def peer_latency_pickle_sync(conn: Connection, transport: str, p: dict[str, Any]) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    conn.send(_bind_raw(sock, transport, p["tmp"], "srpc"))  # type: ignore[arg-type]
    cpu0 = time.process_time()
    while True:
        peer, payload = sock.recv_multipart()
        obj = pickle.loads(payload)
        sock.send_multipart([peer, pickle.dumps(obj, protocol=5)])
        if obj.get("stop"):
            break
    conn.send({"server_cpu_s": time.process_time() - cpu0})
    sock.close(linger=1000)
    ctx.term()


class Peer:
    """The spawned receiving process and the control pipe to it (not on the measured path)."""

    def __init__(self, tmp: str, env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=peer_main, args=(child,), daemon=True)
        saved = dict(os.environ)
        os.environ.update(env or {})  # a spawned child takes the environment of this moment
        try:
            self.proc.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def run(self, kind: str, transport: str, measure: Any, **params: Any) -> Any:
        self.conn.send((kind, transport, {"tmp": self.tmp, **params}))
        addrs = self.conn.recv()
        result = measure(addrs) if kind == "latency_pickle_sync" else uvloop.run(measure(addrs))
        report = self.conn.recv()
        if kind.startswith("latency"):
            return result, report["server_cpu_s"]
        if report:
            raise RuntimeError(f"{kind}/{transport}: receiver dropped messages {report}")
        return result

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(10)


def measure_throughput(peer: Peer, transport: str, size_mib: int, reps: int, quick: bool) -> dict[str, Any]:
    tensor = torch.randn(size_mib * MiB // 4)
    count = 2 if quick else max(4, min(32, 128 // size_mib))
    bursts = reps + 1  # the first burst warms up connections and allocators
    result: dict[str, Any] = {"msgs_per_rep": count, "reps": reps}
    for mode, measure in (("zero_copy", throughput_channel), ("pickle", throughput_pickle)):
        seconds = peer.run(
            f"throughput_{'channel' if mode == 'zero_copy' else 'pickle'}",
            transport,
            lambda addrs, m=measure: m(addrs, tensor, count, bursts),
            count=count,
            bursts=bursts,
        )
        rates = [count * size_mib / s for s in seconds[1:]]
        result[f"{mode}_mib_s"] = round(statistics.median(rates), 1)
    result["zero_copy_over_pickle"] = round(result["zero_copy_mib_s"] / result["pickle_mib_s"], 2)
    return result


def measure_latency(peer: Peer, transport: str, n: int, warmup: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    modes = (
        ("channel", "latency_channel", lambda a: latency_channel(a, n, warmup, tensor=False)),
        ("channel_tensor", "latency_channel", lambda a: latency_channel(a, n, warmup, tensor=True)),
        ("channel_no_busy_poll", "latency_channel", lambda a: latency_channel(a, n, warmup, False, NO_POLL)),
        ("pickle_raw_zmq", "latency_pickle", lambda a: latency_pickle(a, n, warmup)),
        ("pickle_sync_zmq", "latency_pickle_sync", lambda a: latency_pickle_sync(a, n, warmup)),
    )
    for mode, kind, measure in modes:
        (samples, cpu, extra), server_cpu = peer.run(kind, transport, measure)
        out[mode] = _percentiles(samples) | extra
        # CPU seconds per round trip (all threads, zmq's I/O thread included): steadier than
        # wall-clock percentiles when the machine is shared.
        out[mode]["client_cpu_us"] = round(cpu / (n + warmup) * 1e6, 1)
        out[mode]["server_cpu_us"] = round(server_cpu / (n + warmup) * 1e6, 1)
    for mode in ("channel", "channel_no_busy_poll"):
        out[f"p50_{mode}_over_pickle"] = round(out[mode]["p50_us"] / out["pickle_raw_zmq"]["p50_us"], 2)
    return out


# glibc settings for the receiving process (GLIBC_TUNABLES is read at process start).
RECEIVER_MALLOC = {
    "default": "",
    "hugetlb": "glibc.malloc.hugetlb=1",
    "role": ROLE_MALLOC_TUNABLES,
    "heap_no_mmap": "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296",
}


def measure_tuned_receiver(tmp: str, reps: int) -> dict[str, Any]:
    """64 MiB again, with the receiving process's allocator tuned (same for both paths).

    libzmq allocates every incoming message; above glibc's 32 MiB mmap ceiling each one is
    a fresh mapping whose every 4 KiB page faults on first write. `hugetlb` backs malloc
    with transparent huge pages; `heap_no_mmap` serves large blocks from one heap that is
    never trimmed, so the pages of one message are reused by the next; `role` (what the
    launcher gives every role) is the same with a 1 GiB trim threshold.
    """
    out: dict[str, Any] = {}
    for name, tunables in RECEIVER_MALLOC.items():
        peer = Peer(tmp, env={"GLIBC_TUNABLES": tunables})
        try:
            out[name] = {t: measure_throughput(peer, t, 64, reps, quick=False) for t in ("ipc", "tcp")}
        finally:
            peer.close()
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions: a smoke test, not a measurement")
    parser.add_argument("--latency-only", action="store_true", help="only the round-trip latency rows")
    args = parser.parse_args()
    setup_logging(None, "bench", level="warning")  # stderr: stdout carries only the JSON
    reps, n_rtt, warmup = (1, 200, 50) if args.quick else (9, 2000, 300)
    torch.set_num_threads(1)
    started = time.time()
    load_before = os.getloadavg()[0]
    throughput: dict[str, Any] = {}
    latency: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        # The receiving peer gets the malloc setting every Tandem role process gets from the
        # launcher (both the zero-copy and the pickle path are measured with it).
        role_env = {"GLIBC_TUNABLES": ROLE_MALLOC_TUNABLES}
        for transport in ("ipc", "tcp"):
            throughput[transport] = {}
            for size in () if args.latency_only else SIZES_MIB:
                # A fresh receiver per size, as a role receiving one kind of batch (a rollout
                # receiving weight buckets) would be, with the malloc setting every Tandem role
                # process gets from the launcher; the pickle path is measured the same way.
                peer = Peer(tmp, env=role_env)
                try:
                    throughput[transport][f"{size}MiB"] = measure_throughput(peer, transport, size, reps, args.quick)
                finally:
                    peer.close()
            peer = Peer(tmp, env=role_env)
            try:
                latency[transport] = measure_latency(peer, transport, n_rtt, warmup)
            finally:
                peer.close()
        if not (args.quick or args.latency_only):
            tuned = measure_tuned_receiver(tmp, reps)  # other malloc settings, for comparison
    ipc_p50 = latency["ipc"]["channel"]["p50_us"]
    targets = {"ipc_rtt_p50_under_200us": ipc_p50 < 200.0}
    if not args.latency_only:
        targets["ipc_64MiB_zero_copy_over_pickle_ge_3"] = throughput["ipc"]["64MiB"]["zero_copy_over_pickle"] >= 3.0
    print(
        json.dumps(
            {
                "benchmark": "transport",
                "quick": args.quick,
                "machine": _machine(),
                "throughput_mib_s": throughput,
                "latency_us": latency,
                **({} if args.quick or args.latency_only else {"throughput_64MiB_by_receiver_malloc": tuned}),
                "targets": targets,
                "seconds": round(time.time() - started, 1),
                "loadavg_1min": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
            }
        )
    )


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
