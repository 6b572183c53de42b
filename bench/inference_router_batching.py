"""Inference-router worker: throughput at a fixed p99, with and without dynamic batching.

Triton's anchor: dynamic batching alone took a model from 73 to 272 inferences/s at the same
latency bound. Here one real worker process (pool kind cpu, replicas of ``--threads`` intra-op
threads) hosts the same ONNX MLP twice: ``single`` (no dynamic batching: one request per run) and
``batched`` (dynamic batching, max batch 32, ``--delay-us`` queue delay). Closed-loop clients
(grpc.aio in this process, KServe v2 ModelInfer with one row each) sweep the concurrency; for each
mode and each latency bound of ``--p99-ms`` the best throughput whose p99 stays within it is
reported, and the ratio. First, what a worker call adds to onnxruntime itself: one client calling a
tiny model (16-64-64-4) versus running it on a bare session in this process, p50s.

    .venv/bin/python bench/inference_router_batching.py
    .venv/bin/python bench/inference_router_batching.py --p99-ms 25,50 --duration 2 --concurrency 1,8,32,64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import yaml
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from opml_inference_router.kserve import encode_request
from opml_inference_router.testing import mlp_classifier, mlp_config, write_model_dir
from opml_inference_router.worker import WorkerProcess

FEATURES, WIDTH, DEPTH, CLASSES = 512, 2048, 3, 10


def fleet() -> dict:
    return {"pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 8192, "slots": 3,
                            "cost_per_hour": 1.6, "execution_provider": "CPUExecutionProvider"}],
            "pools": [{"name": "cpu-a", "kind": "cpu", "workers": 1}]}


async def closed_loop(target: str, model: str, concurrency: int, duration_s: float,
                      features: int = FEATURES) -> tuple[float, list[float]]:
    """``concurrency`` clients each sending one-row requests back to back; (inferences/s, latencies ms)."""
    rows = np.random.default_rng(0).standard_normal((256, features)).astype(np.float32)
    requests = [encode_request(model, {"features": rows[i:i + 1]}).SerializeToString() for i in range(256)]
    channels = [grpc.aio.insecure_channel(target) for _ in range(min(4, concurrency))]
    calls = [channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                 request_serializer=lambda raw: raw,
                                 response_deserializer=pb.ModelInferResponse.FromString) for channel in channels]
    latencies: list[float] = []
    stop_at = 0.0

    async def client(index: int) -> None:
        call = calls[index % len(calls)]
        sent = index
        while time.perf_counter() < stop_at:
            start = time.perf_counter()
            await call(requests[sent % len(requests)], timeout=10)
            latencies.append((time.perf_counter() - start) * 1000.0)
            sent += 1

    stop_at = time.perf_counter() + 0.3  # warm-up, not recorded
    await asyncio.gather(*[client(i) for i in range(concurrency)])
    latencies.clear()
    began = time.perf_counter()
    stop_at = began + duration_s
    await asyncio.gather(*[client(i) for i in range(concurrency)])
    elapsed = time.perf_counter() - began
    for channel in channels:
        await channel.close()
    return len(latencies) / elapsed, latencies


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def onnxruntime_direct_ms(model_bytes: bytes, threads: int, features: int = FEATURES, runs: int = 200) -> float:
    """p50 of one-row runs of the same model on a bare onnxruntime session (what a worker call adds to)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(model_bytes, options)
    row = np.random.default_rng(1).standard_normal((1, features)).astype(np.float32)
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, {"features": row})
        samples.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(samples[20:])


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="opml-bench-batching-") as work:
        run(Path(work))


def run(work: Path) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--p99-ms", default="50,100", help="latency bounds for the comparison, comma separated")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds measured per concurrency level")
    parser.add_argument("--concurrency", default="1,4,16,32,64", help="closed-loop clients, comma separated")
    parser.add_argument("--delay-us", type=int, default=1000, help="dynamic batching max queue delay")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of the replica")
    args = parser.parse_args()
    levels = [int(level) for level in args.concurrency.split(",")]
    bounds = [float(bound) for bound in args.p99_ms.split(",")]

    model = mlp_classifier(features=FEATURES, width=WIDTH, depth=DEPTH, classes=CLASSES)
    (work / "fleet.yaml").write_text(yaml.safe_dump(fleet()))
    common = {"features": FEATURES, "classes": CLASSES, "max_batch_size": 32, "pool_kinds": ("cpu",),
              "precisions": ("fp32",)}
    write_model_dir(work / "models" / "single", mlp_config("single", max_queue_delay_us=None, **common), model)
    write_model_dir(work / "models" / "batched", mlp_config("batched", max_queue_delay_us=args.delay_us, **common),
                    model)
    tiny = mlp_classifier(features=16, width=64, depth=2, classes=4)
    write_model_dir(work / "models" / "tiny", mlp_config("tiny", max_queue_delay_us=None, pool_kinds=("cpu",),
                                                         precisions=("fp32",)), tiny)
    direct_ms = onnxruntime_direct_ms(model.SerializeToString(), args.threads)
    tiny_direct_ms = onnxruntime_direct_ms(tiny.SerializeToString(), args.threads, features=16, runs=2000)

    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores; MLP {FEATURES}-"
          f"{'-'.join([str(WIDTH)] * DEPTH)}-{CLASSES} fp32, one row per request; replica: {args.threads} "
          f"intra-op thread(s); batching: max 32, delay {args.delay_us} us; {args.duration:g} s per level")
    print(f"# onnxruntime direct, one row: p50 {direct_ms:.2f} ms")
    worker = WorkerProcess("cpu", work / "fleet.yaml", work / "worker.log", models_dir=work / "models",
                           extra_args=("--threads-per-replica", str(args.threads)),
                           env={"OPML_LOG_LEVEL": "WARNING"})
    with worker:
        with grpc.insecure_channel(worker.target) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            for name in ("tiny", "single", "batched"):
                stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=name), timeout=60)
        _, tiny_latencies = asyncio.run(closed_loop(worker.target, "tiny", 1, args.duration, features=16))
        tiny_ms = statistics.median(tiny_latencies)
        print(f"# worker call overhead, tiny model, one client: p50 {tiny_ms:.3f} ms through the worker vs "
              f"{tiny_direct_ms:.3f} ms on a bare session: +{tiny_ms - tiny_direct_ms:.3f} ms")
        results: dict[str, list[tuple[float, float]]] = {}
        print("\n| mode | clients | inferences/s | p50 ms | p99 ms |")
        print("|---|---:|---:|---:|---:|")
        for name in ("single", "batched"):
            results[name] = []
            for level in levels:
                rate, latencies = asyncio.run(closed_loop(worker.target, name, level, args.duration))
                results[name].append((rate, p99(latencies)))
                print(f"| {name} | {level} | {rate:.0f} | {statistics.median(latencies):.2f} | "
                      f"{results[name][-1][1]:.2f} |", flush=True)
    print()
    for bound in bounds:
        single, batched = (max((rate for rate, tail in results[name] if tail <= bound), default=0.0)
                           for name in ("single", "batched"))
        ratio = f"{batched / single:.2f}x" if single else "n/a"
        print(f"best throughput with p99 <= {bound:g} ms: without dynamic batching {single:.0f} inferences/s, "
              f"with it {batched:.0f} inferences/s ({ratio}; Triton's anchor: 73 -> 272, 3.73x)")

if __name__ == "__main__":
    main()
