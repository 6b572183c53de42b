"""The worker's own cost per call: one worker process driven on its Unix socket, as the native front drives it.

The front sends each ModelInfer straight to a worker (the direct data plane); what the worker then spends
per call (reading frames, decoding, batching, the model run, encoding, the answer's send) is most of the
serving stack's CPU per request (docs/benchmarks.md, *Serving tail*). This drives one real worker (its
process, its Unix socket, the reference MLP 256-512-512-10 with batching up to 32 rows, 2 ms delay) with
closed-loop callers over the frame protocol, and reads the worker process's CPU from /proc around each
level. The baseline, measured in the same run: onnxruntime's own run of the same model in this process,
one call per row (the CPU a call costs with no serving around it). Printed per caller count: calls/s,
p50/p99, worker CPU µs per call, and its ratio to the baseline's.

    .venv/bin/python bench/inference_router_worker_calls.py
    .venv/bin/python bench/inference_router_worker_calls.py --callers 1,8,32 --duration 5 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import psutil
import yaml
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from opml_inference_router.kserve import encode_request
from opml_inference_router.routing.uds_replica import UdsReplica
from opml_inference_router.testing import mlp_classifier, mlp_config, write_model_dir
from opml_inference_router.worker import WorkerProcess

FEATURES, WIDTH, DEPTH, CLASSES = 256, 512, 2, 10
FLEET = {"pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 4096, "slots": 4,
                         "cost_per_hour": 1.0, "execution_provider": "CPUExecutionProvider"}],
         "pools": [{"name": "cpu-a", "kind": "cpu", "workers": 1}]}


def baseline_us(model: bytes, rows: np.ndarray) -> float:
    """CPU µs of one onnxruntime run of one row in this process (one thread, as a worker's slot runs it)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    for row in rows[:200]:
        session.run(None, {"features": row[None]})
    start = time.thread_time()
    for row in rows:
        session.run(None, {"features": row[None]})
    return (time.thread_time() - start) / len(rows) * 1e6


async def level(replica: UdsReplica, requests: list[bytes], process: psutil.Process, callers: int,
                duration_s: float) -> tuple[int, list[float], float]:
    """(calls answered, latencies s, worker CPU s) of ``callers`` closed-loop callers for ``duration_s``."""
    latencies: list[float] = []
    stop = time.perf_counter() + duration_s

    async def caller(index: int) -> None:
        i = index
        while time.perf_counter() < stop:
            began = time.perf_counter()
            await replica.call("ModelInfer", requests[i % len(requests)], timeout_s=5)
            latencies.append(time.perf_counter() - began)
            i += callers

    before = process.cpu_times()
    await asyncio.gather(*(caller(i) for i in range(callers)))
    after = process.cpu_times()
    return len(latencies), latencies, (after.user - before.user) + (after.system - before.system)


async def drive(socket: Path, pid: int, args: argparse.Namespace, base_us: float) -> None:
    rng = np.random.default_rng(0)
    requests = [encode_request("mlp", {"features": rng.standard_normal((1, FEATURES)).astype(np.float32)},
                               request_id=f"r{i}").SerializeToString() for i in range(256)]
    replica = UdsReplica(f"uds:{socket}")
    process = psutil.Process(pid)
    try:
        await level(replica, requests, process, 8, 1.0)  # warm-up
        rows = []
        for round_ in range(1, args.rounds + 1):
            for callers in args.callers:
                count, latencies, cpu_s = await level(replica, requests, process, callers, args.duration)
                latencies.sort()
                per_call_us = cpu_s / count * 1e6
                rows.append((callers, round_, count / args.duration, latencies[len(latencies) // 2] * 1e3,
                             latencies[int(len(latencies) * 0.99)] * 1e3, per_call_us))
    finally:
        await replica.close()
    print(f"\nbaseline: onnxruntime's own run of one row, {base_us:.1f} CPU µs a call\n")
    print("| callers | calls/s | p50 ms | p99 ms | worker CPU µs a call | ÷ baseline |")
    print("|---:|---:|---:|---:|---:|---:|")
    for callers in args.callers:
        mine = [row for row in rows if row[0] == callers]
        rate = [row[2] for row in mine]
        cpu = [row[5] for row in mine]
        print(f"| {callers} | {min(rate):,.0f}-{max(rate):,.0f} | {statistics.median(r[3] for r in mine):.2f} | "
              f"{statistics.median(r[4] for r in mine):.2f} | {min(cpu):.0f}-{max(cpu):.0f} | "
              f"{min(cpu) / base_us:.1f}-{max(cpu) / base_us:.1f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--callers", default="1,8,32", type=lambda text: [int(c) for c in text.split(",")])
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per level")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = mlp_classifier(features=FEATURES, width=WIDTH, depth=DEPTH, classes=CLASSES)
    base_us = baseline_us(model.SerializeToString(),
                          np.random.default_rng(1).standard_normal((3000, FEATURES)).astype(np.float32))
    with tempfile.TemporaryDirectory(prefix="opml-bench-worker-") as tmp:
        root = Path(tmp)
        (root / "fleet.yaml").write_text(yaml.safe_dump(FLEET))
        write_model_dir(root / "models" / "mlp", mlp_config("mlp", features=FEATURES, classes=CLASSES,
                                                            max_queue_delay_us=2000), model)
        worker = WorkerProcess("cpu", root / "fleet.yaml", root / "worker.log", models_dir=root / "models",
                               uds=root / "cpu.sock").start()
        try:
            with grpc.insecure_channel(worker.target) as channel:
                service_pb2_grpc.GRPCInferenceServiceStub(channel).RepositoryModelLoad(
                    pb.RepositoryModelLoadRequest(model_name="mlp"), timeout=60)
            pid = worker.process.pid  # type: ignore[union-attr]
            print(f"# one worker process (pid {pid}), MLP {FEATURES}-{WIDTH}-{WIDTH}-{CLASSES} fp32, batching "
                  f"32 rows / 2 ms, one row a call; {args.rounds} round(s) of {args.duration:g} s per level; "
                  f"load average {' '.join(f'{x:.1f}' for x in psutil.getloadavg())}")
            asyncio.run(drive(root / "cpu.sock", pid, args, base_us))
        finally:
            worker.stop()


if __name__ == "__main__":
    main()
