"""CPU time per request of the router, each worker and MLServer, under the same tritonclient load, interleaved.

On two cores shared with the load generator (and, on the development machine, with other people's
work) throughput says little; what each serving process spends per request does. This bench serves
the peers bench's MLP (``--features`` x ``--width`` x ``--depth``, batching max 32, ``--delay-ms``)
as ours (the router process of bench/inference_router_peers.py over ``--replicas`` worker processes
on their Unix sockets, hedging on; called on its native inference front and on its Python gRPC port,
``--fronts``) and as MLServer 1.7.1 (``parallel_workers`` = ``--mlserver-workers``;
0 runs inference in the server process, its best setting on 2 cores), drives each with
``--concurrency`` closed-loop tritonclient aio callers (an InferInput built per request) for
``--duration`` s after a warm-up, and reads each process's CPU time (user + system, every thread,
from /proc; MLServer's children included) around the window. The systems take turns, ``--rounds``
times, so a change of the machine's load hits them alike; each round prints every system's CPU
microseconds per request (ours by process: router, each worker), requests per CPU-second and ours
÷ MLServer in that round.

    .venv/bin/python bench/inference_router_cpu.py
    .venv/bin/python bench/inference_router_cpu.py --replicas 1,2 --concurrency 8,32 --rounds 3

To compare two versions of the router in one session, run it with the other version's
``services/inference-router/src`` first on ``PYTHONPATH`` (its processes inherit it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import tritonclient.grpc.aio as triton
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from opml_inference_router.testing import front_process, mlp_classifier, mlp_config, write_model_dir
from opml_inference_router.worker.process import WorkerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
import inference_router_peers as peers  # noqa: E402 - the peers bench's servers, venvs and CPU meter

MODEL = peers.MODEL


def thread_cpu_s(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid`` so far."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


async def drive(port: int, callers: int, duration_s: float, rows: np.ndarray) -> tuple[int, float, float]:
    """Closed-loop tritonclient callers on two channels: (requests answered, p50 ms, p99 ms)."""
    clients = [triton.InferenceServerClient(f"127.0.0.1:{port}") for _ in range(2)]
    latencies: list[float] = []
    stop_at = time.perf_counter() + duration_s

    async def caller(index: int) -> None:
        number = index
        while time.perf_counter() < stop_at:
            row = rows[number % len(rows)][None, :]
            number += callers
            tensor = triton.InferInput("features", list(row.shape), "FP32")
            tensor.set_data_from_numpy(row)
            began = time.perf_counter()
            await clients[index % 2].infer(MODEL, [tensor], client_timeout=30)
            latencies.append((time.perf_counter() - began) * 1000.0)
    try:
        await asyncio.gather(*(caller(i) for i in range(callers)))
    finally:
        for client in clients:
            await client.close()
    latencies.sort()
    return len(latencies), latencies[len(latencies) // 2], latencies[int(0.99 * (len(latencies) - 1))]


def measure(port: int, meters: dict[str, object], args: argparse.Namespace, callers: int,
            rows: np.ndarray) -> dict:
    """Warm up, then one window: rate, latency and CPU seconds per request of each meter."""
    asyncio.run(drive(port, callers, args.warmup, rows))
    load = os.getloadavg()[0]
    before = {name: read() for name, read in meters.items()}
    began = time.perf_counter()
    count, p50, p99 = asyncio.run(drive(port, callers, args.duration, rows))
    elapsed = time.perf_counter() - began
    used = {name: read() - before[name] for name, read in meters.items()}
    return {"load": load, "rate": count / elapsed, "p50": p50, "p99": p99,
            "us": {name: seconds / count * 1e6 for name, seconds in used.items()}}


def serve_ours(work: Path, bundle: Path, replicas: int, native: bool, args: argparse.Namespace, callers: list[int],
               rows: np.ndarray) -> dict[int, dict]:
    workers = []
    router = None
    try:
        for index in range(replicas):
            worker = WorkerProcess("cpu", peers.FLEET, work / f"worker-{index}.log", env={"OPML_LOG_LEVEL": "WARNING"},
                                   extra_args=("--threads-per-replica", "1"), uds=work / f"worker-{index}.sock")
            workers.append(worker)
            worker.start()
            with grpc.insecure_channel(worker.target) as channel:
                load = pb.RepositoryModelLoadRequest(model_name=MODEL)
                load.parameters["path"].string_param = str(bundle)
                service_pb2_grpc.GRPCInferenceServiceStub(channel).RepositoryModelLoad(load, timeout=120)
        router = subprocess.Popen([sys.executable, peers.__file__, "--serve-router",
                                   ",".join(w.local_target for w in workers), str(bundle),
                                   *(["--native-front"] if native else [])],
                                  stdout=subprocess.PIPE, stderr=open(work / "router.log", "ab"))  # noqa: SIM115
        announced = json.loads(router.stdout.readline())
        port = announced["inference_port" if native else "grpc_port"]
        meters = {"router": (lambda pid=router.pid: thread_cpu_s(pid))}
        if native:
            front = front_process(router.pid)
            meters["front"] = lambda pid=front.pid: thread_cpu_s(pid)
        meters.update({f"worker {i}": (lambda pid=w.process.pid: thread_cpu_s(pid)) for i, w in enumerate(workers)})
        return {level: measure(port, meters, args, level, rows) for level in callers}
    finally:
        if router is not None:
            peers.stop(router)
        for worker in workers:
            worker.stop()


def serve_mlserver(work: Path, onnx_path: Path, python: Path, args: argparse.Namespace, callers: list[int],
                   rows: np.ndarray) -> dict[int, dict]:
    root = Path(tempfile.mkdtemp(prefix="mlserver-", dir=work))
    settings = argparse.Namespace(max_batch=32, delay_ms=args.delay_ms, threads=1)
    port = peers.mlserver_repository(root, onnx_path, settings, args.mlserver_workers)
    log = root / "mlserver.log"
    process, _ = peers.start([str(python.parent / "mlserver"), "start", str(root)], log,
                             env={"PYTHONPATH": str(peers.BENCH)}, announce=False)
    try:
        peers.wait_model_ready(f"127.0.0.1:{port}", process, log)
        meter = peers.CpuMeter([process.pid])
        return {level: measure(port, {"mlserver": meter.seconds}, args, level, rows) for level in callers}
    finally:
        peers.stop(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=2.0)
    parser.add_argument("--replicas", default="1,2", help="our worker processes, comma separated settings")
    parser.add_argument("--fronts", default="native,python", help="the router's fronts to measure: native (its "
                        "inference port, the C++ front, metered as its own process), python (its gRPC port)")
    parser.add_argument("--mlserver-workers", type=int, default=0, help="MLServer parallel_workers (0: in-process)")
    parser.add_argument("--concurrency", default="8,32", help="closed-loop callers, comma separated")
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-mlserver", action="store_true", help="ours only (e.g. two router versions)")
    args = parser.parse_args()
    callers = [int(level) for level in args.concurrency.split(",")]
    python = None if args.no_mlserver else peers.peer_python("mlserver")
    with tempfile.TemporaryDirectory(prefix="opml-bench-cpu-") as tmp:
        work = Path(tmp)
        config = mlp_config(MODEL, features=args.features, classes=peers.CLASSES, max_batch_size=32,
                            max_queue_delay_us=int(args.delay_ms * 1000), pool_kinds=("cpu",), precisions=("fp32",))
        bundle = write_model_dir(work / MODEL, config, mlp_classifier(features=args.features, width=args.width,
                                                                      depth=args.depth, classes=peers.CLASSES))
        rows = np.random.default_rng(0).standard_normal((peers.ROWS, args.features)).astype(np.float32)
        print(f"# MLP {args.features}-{'-'.join([str(args.width)] * args.depth)}-{peers.CLASSES}, batching max 32, "
              f"{args.delay_ms:g} ms; tritonclient aio callers; {args.duration:g} s per level; {os.cpu_count()} cores")
        print("\n| round | system | callers | load | req/s | p50 ms | p99 ms | CPU us/request (by process) | "
              "req per CPU-s | ours ÷ MLServer per CPU-s |\n|---:|---|---:|---:|---:|---:|---:|---|---:|---:|")
        for round_number in range(1, args.rounds + 1):
            results = {f"ours{' native' if front == 'native' else ''} x{count}":
                       serve_ours(work, bundle, count, front == "native", args, callers, rows)
                       for front in args.fronts.split(",") for count in (int(c) for c in args.replicas.split(","))}
            if python is not None:
                results[f"MLServer ({args.mlserver_workers} workers)" if args.mlserver_workers
                        else "MLServer (in-process)"] = serve_mlserver(work, bundle / "model.onnx", python, args,
                                                                        callers, rows)
            for level in callers:
                peer = next((r[level] for name, r in results.items() if name.startswith("MLServer")), None)
                peer_per_cpu = peer and 1e6 / sum(peer["us"].values())
                for name, by_level in results.items():
                    cell = by_level[level]
                    total = sum(cell["us"].values())
                    parts = ", ".join(f"{part} {us:.0f}" for part, us in cell["us"].items())
                    ratio = (f"{1e6 / total / peer_per_cpu:.2f}x" if peer_per_cpu and name.startswith("ours")
                             else "")
                    print(f"| {round_number} | {name} | {level} | {cell['load']:.1f} | {cell['rate']:.0f} | "
                          f"{cell['p50']:.2f} | {cell['p99']:.2f} | {total:.0f} ({parts}) | {1e6 / total:.0f} | "
                          f"{ratio} |", flush=True)


if __name__ == "__main__":
    main()
