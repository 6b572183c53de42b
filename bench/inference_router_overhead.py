"""Inference-router overhead: what the router adds over calling onnxruntime directly.

The same ONNX model (the test MLP, ``--features`` x ``--width`` x ``--depth``) is called eight ways,
``--requests`` times each, one request at a time (latency, not throughput), after a warm-up; the
gRPC paths take turns in ``--rounds`` rounds, so a change of the machine's load hits them alike:

  (a) onnxruntime in this process (``InferenceSession.run``, batch 1);
  (b) one worker process directly over gRPC (KServe v2 ModelInfer, grpc.aio, pre-serialized request);
  (c) the router (its own process: the KServe v2 frontend, the Router, a GrpcReplica) to that worker
      over gRPC on TCP (how it calls a worker on another machine);
  (u) the same router to the same worker over the worker's Unix socket (a UdsReplica: the worker's
      local data plane, worker/uds.py; how the pool manager wires its workers with ``route_over_uds``);
  (n) the same as (u), called on the router's native inference front (native/front.cc, the router's
      inference port) instead of its Python gRPC port;
  (d) the router with the model in its own process (a LocalReplica over the worker's servicer and
      ModelRepository, dynamic batching included): one gRPC hop instead of two;
  (m) the same as (d), called on the router's native front: what serving a model inside the router's
      process would give, with no worker process at all (the floor of any design that keeps a
      Python router);
  (p) for reference, the floor of any Python gRPC hop: a bare grpc.aio server in its own process that
      forwards the bytes to the worker (no routing, no interceptors, no metrics).

It prints p50/p99/mean per path, what (b) adds over (a) and what (c), (u) and (n) add over (b), the
router's overhead, and how much of it the bare hop (p) already costs. Then ``--concurrency`` clients in
parallel for the throughput of each gRPC path. Workers run without dynamic batching here, so no
batching delay hides in the numbers.

Then where path (n)'s time goes, from three more paths measured one request at a time in the same rounds:

  (h) a health check the native front answers itself: this client, gRPC and the C++ front, the floor
      of any gRPC server on this machine;
  (l) ServerLive on the native front, answered by the router: (h) plus the hop to the router and back;
  (w) ModelInfer on the worker's Unix socket from this process, as the router sends it (no gRPC).

(h) - (a) is what calling over gRPC costs at all, (l) - (h) the router's hop, (n) - (l) the worker's hop
and work plus the router's routing.

    .venv/bin/python bench/inference_router_overhead.py
    .venv/bin/python bench/inference_router_overhead.py --requests 5000 --width 512 --depth 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from opml_inference_router.kserve import encode_request
from opml_inference_router.routing.uds_replica import UdsReplica
from opml_inference_router.testing import mlp_classifier, mlp_config, write_model_dir
from opml_inference_router.worker.process import WorkerProcess

FLOOR_PATHS = ("(h) health check answered by the native front", "(l) ServerLive: native front -> router",
               "(w) worker over its Unix socket, from this process")
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
SERVER_LIVE = f"/{pb.DESCRIPTOR.services_by_name['GRPCInferenceService'].full_name}/ServerLive"
FLEET = Path(__file__).resolve().parents[1] / "services" / "inference-router" / "examples" / "fleet.yaml"
MODEL = "bench-mlp"
INFER = f"/{pb.DESCRIPTOR.services_by_name['GRPCInferenceService'].full_name}/ModelInfer"


async def serve_router(worker: str, native: bool) -> None:
    """The router as its own process: frontend + Router over one worker (``--serve-router ADDRESS``),
    or over a LocalReplica hosting the bundle in this process (``--serve-router local:BUNDLE``); with
    ``native`` its native inference front too, announced as ``inference_port``."""
    from opml_common.config import PlatformSettings, ServiceSettings
    from opml_common.grpc.server import GrpcServer, wait_for_signal
    from opml_common.metrics import ServiceMetrics
    from opml_inference_router.frontend import InferenceFrontend
    from opml_inference_router.native_front import FrontLink, NativeFront
    from opml_inference_router.placement.fleet_config import load_fleet_config
    from opml_inference_router.routing import ModelPolicy, Router
    from opml_inference_router.routing.local_replica import LocalReplica
    from opml_inference_router.routing.uds_replica import connect
    from opml_inference_router.runtime import ModelRepository, WorkerMetrics
    from opml_inference_router.worker.servicer import WorkerServicer

    metrics = ServiceMetrics("inference-router")
    repository = None
    if worker.startswith("local:"):
        cpu = next(kind for kind in load_fleet_config(FLEET).pool_kinds if kind.name == "cpu")
        repository = ModelRepository(cpu, metrics=WorkerMetrics(metrics), threads=1)
        await repository.load(MODEL, path=worker.removeprefix("local:"), version=1)
        local = LocalReplica(WorkerServicer(repository, server_name="router", server_version="0"), name=worker)
    router = Router(connect=lambda address: local if repository is not None else connect(address),
                    metrics=metrics)
    router.set_model(MODEL, ModelPolicy(slo_p99_ms=50, max_concurrency=256, max_queue=1024))
    router.add_replica(MODEL, "1", worker)
    frontend = InferenceFrontend(router)
    server = GrpcServer(settings=ServiceSettings(host="127.0.0.1", grpc_port=0, metrics_port=0),
                        platform=PlatformSettings(auth_tokens="", log_level="WARNING"), metrics=metrics,
                        registrations=[frontend.registration()])
    front = NativeFront(FrontLink(frontend, tokens={}, metrics=metrics), host="127.0.0.1", port=0,
                        max_receive_bytes=server.max_receive_message_bytes, grace_s=5.0, tls=None, control_hint="",
                        metrics=metrics) if native else None
    async with server:
        if front is not None:
            await front.start()
        print(json.dumps({"grpc_port": server.port, "inference_port": front and front.port}), flush=True)
        await wait_for_signal()
        if front is not None:
            await front.stop()
    await router.close()
    if repository is not None:
        await repository.close()


async def serve_proxy(worker: str) -> None:
    """A bare pass-through hop as its own process (``--serve-proxy``): the reference path (p)."""
    from opml_common.grpc.server import wait_for_signal

    async with grpc.aio.insecure_channel(worker) as channel:
        call = channel.unary_unary(INFER)

        async def infer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return await call(request, timeout=context.time_remaining())

        server = grpc.aio.server()
        service, method = INFER.strip("/").split("/")
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            service, {method: grpc.unary_unary_rpc_method_handler(infer)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(json.dumps({"grpc_port": port}), flush=True)
        await wait_for_signal()
        await server.stop(1)


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50": ordered[len(ordered) // 2] * 1000, "p99": ordered[int(0.99 * (len(ordered) - 1))] * 1000,
            "mean": statistics.fmean(ordered) * 1000}


def bench_in_process(model_path: Path, data: np.ndarray, requests: int, warmup: int) -> list[float]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    feeds = {"features": data}
    for _ in range(warmup):
        session.run(None, feeds)
    samples = []
    for _ in range(requests):
        start = time.perf_counter()
        session.run(None, feeds)
        samples.append(time.perf_counter() - start)
    return samples


async def bench_grpc(target: str, request: bytes, requests: int, warmup: int,
                     concurrency: int, method: str = INFER) -> tuple[list[float], float]:
    """Latencies of ``requests`` calls from ``concurrency`` callers, and the throughput (requests/s)."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary(method)
        for _ in range(warmup):
            await call(request, timeout=10)
        samples: list[float] = []
        remaining = requests

        async def caller() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                start = time.perf_counter()
                await call(request, timeout=10)
                samples.append(time.perf_counter() - start)

        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        return samples, len(samples) / (time.perf_counter() - started)


async def bench_uds(address: str, request: bytes, requests: int, warmup: int) -> list[float]:
    """Latencies of ``requests`` ModelInfer calls, one at a time, on a worker's Unix socket (path (w))."""
    replica = UdsReplica(address)
    try:
        for _ in range(warmup):
            await replica.call("ModelInfer", request, timeout_s=10)
        samples = []
        for _ in range(requests):
            start = time.perf_counter()
            await replica.call("ModelInfer", request, timeout_s=10)
            samples.append(time.perf_counter() - start)
        return samples
    finally:
        await replica.close()


def start_hop(kind: str, worker: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    """Start this script as ``--serve-router`` (``native-router``: called on its native front) or
    ``--serve-proxy``; returns the process and its address."""
    native = kind == "native-router"
    with open(log_path, "ab") as log:
        process = subprocess.Popen([sys.executable, __file__, f"--serve-{kind.removeprefix('native-')}", worker,
                                    *(["--native-front"] if native else [])], stdout=subprocess.PIPE,
                                   stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        process.wait()
        raise RuntimeError(f"router exited with {process.returncode}:\n{log_path.read_text()[-2000:]}")
    return process, f"127.0.0.1:{json.loads(line)['inference_port' if native else 'grpc_port']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--serve-router", metavar="WORKER", help=argparse.SUPPRESS)
    parser.add_argument("--serve-proxy", metavar="WORKER", help=argparse.SUPPRESS)
    parser.add_argument("--native-front", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_router:
        asyncio.run(serve_router(args.serve_router, args.native_front))
        return
    if args.serve_proxy:
        asyncio.run(serve_proxy(args.serve_proxy))
        return

    random.seed(0)
    with tempfile.TemporaryDirectory(prefix="opml-bench-") as tmp:
        work = Path(tmp)
        config = mlp_config(MODEL, features=args.features, max_queue_delay_us=None, max_batch_size=8)
        model = mlp_classifier(features=args.features, width=args.width, depth=args.depth)
        bundle = write_model_dir(work / MODEL, config, model, versions=(1,))
        data = np.random.default_rng(0).standard_normal((1, args.features)).astype(np.float32)
        request = encode_request(MODEL, {"features": data}, version="1").SerializeToString()

        print(f"# inference-router overhead: MLP {args.features}x{args.width}x{args.depth}, batch 1, "
              f"{args.requests} requests per path, Python {platform.python_version()}, {os.cpu_count()} CPUs")
        results = {"(a) onnxruntime in-process": bench_in_process(bundle / "1" / "model.onnx", data, args.requests,
                                                                  args.warmup)}
        worker = WorkerProcess("cpu", FLEET, work / "worker.log", extra_args=("--threads-per-replica", "1"),
                               uds=work / "worker.sock").start()
        hops: list[subprocess.Popen] = []
        try:
            with grpc.insecure_channel(worker.target) as channel:
                load = pb.RepositoryModelLoadRequest(model_name=MODEL)
                load.parameters["path"].string_param = str(bundle)
                service_pb2_grpc.GRPCInferenceServiceStub(channel).RepositoryModelLoad(load, timeout=60)
            assert worker.uds_target is not None
            paths = {"(b) worker over gRPC": worker.target}
            for name, kind, to in (("(c) router -> worker (TCP)", "router", worker.target),
                                   ("(u) router -> worker (Unix socket)", "router", worker.uds_target),
                                   ("(n) native front -> router -> worker (Unix socket)", "native-router",
                                    worker.uds_target),
                                   ("(d) router, model in-process", "router", f"local:{bundle}"),
                                   ("(m) native front -> router, model in-process", "native-router",
                                    f"local:{bundle}"),
                                   ("(p) bare grpc.aio hop -> worker", "proxy", worker.target)):
                process, paths[name] = start_hop(kind, to, work / f"{kind}-{len(hops)}.log")
                hops.append(process)
            native = paths["(n) native front -> router -> worker (Unix socket)"]
            floors = {FLOOR_PATHS[0]: (native, HEALTH_CHECK), FLOOR_PATHS[1]: (native, SERVER_LIVE)}
            throughput: dict[str, list[float]] = {name: [] for name in paths}
            per_round = max(1, args.requests // args.rounds)
            for name in (*paths, *FLOOR_PATHS):
                results[name] = []
            for _ in range(args.rounds):
                for name, target in paths.items():
                    samples, _ = asyncio.run(bench_grpc(target, request, per_round, args.warmup // args.rounds, 1))
                    results[name] += samples
                    _, rps = asyncio.run(bench_grpc(target, request, per_round, 0, args.concurrency))
                    throughput[name].append(rps)
                for name, (target, method) in floors.items():
                    results[name] += asyncio.run(bench_grpc(target, b"", per_round, args.warmup // args.rounds, 1,
                                                            method))[0]
                results[FLOOR_PATHS[2]] += asyncio.run(bench_uds(worker.uds_target, request, per_round,
                                                                 args.warmup // args.rounds))
        finally:
            for hop in hops:
                hop.terminate()
                hop.wait(10)
            worker.stop()

    stats = {name: percentiles(samples) for name, samples in results.items()}
    print("\n| path | p50 ms | p99 ms | mean ms |\n|---|---|---|---|")
    for name, s in stats.items():
        print(f"| {name} | {s['p50']:.3f} | {s['p99']:.3f} | {s['mean']:.3f} |")
    a, b, c, u, n, d, m, p, h, live, w = stats.values()
    print("\n| added by | p50 ms | p99 ms | ratio p50 |\n|---|---|---|---|")
    for label, slow, fast in (("worker + gRPC, (b) - (a)", b, a),
                              ("router over TCP, (c) - (b)", c, b),
                              ("router over the Unix socket, (u) - (b)", u, b),
                              ("router's native front over the Unix socket, (n) - (b)", n, b),
                              ("bare grpc.aio hop, (p) - (b)", p, b),
                              ("router, model in-process, (d) - (a)", d, a),
                              ("native front + router, model in-process, (m) - (a)", m, a),
                              ("router + worker over TCP, (c) - (a)", c, a),
                              ("router + worker over the Unix socket, (u) - (a)", u, a),
                              ("native front + router + worker over the Unix socket, (n) - (a)", n, a)):
        print(f"| {label} | {slow['p50'] - fast['p50']:.3f} | {slow['p99'] - fast['p99']:.3f} | "
              f"{slow['p50'] / fast['p50']:.2f}x |")
    print("\n| where (n)'s time goes | p50 ms | share of (n) - (a) |\n|---|---|---|")
    for label, slow, fast in (("calling over gRPC at all: client, gRPC, the C++ front, (h) - (a)", h, a),
                              ("the router's hop (ServerLive), (l) - (h)", live, h),
                              ("routing, the worker's hop and its work, (n) - (l)", n, live),
                              ("  of which the worker's hop and work as the router calls it, (w)", w, None)):
        added = slow["p50"] - (fast["p50"] if fast is not None else 0.0)
        print(f"| {label} | {added:.3f} | {added / (n['p50'] - a['p50']):.0%} |")
    print(f"\nthroughput with {args.concurrency} concurrent callers: "
          + ", ".join(f"{name}: {statistics.median(rps):.0f} req/s" for name, rps in throughput.items()))


if __name__ == "__main__":
    main()
