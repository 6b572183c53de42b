"""Inference-router: the first placement against the placement after calibration, in the same run.

Issue 12, item 2: a model was first placed with a batch cap of 1 from a profile of its execution
alone and served half of what the plan after the replanner's calibration served. Now the router
profiles the real request path before the first plan. This bench deploys one model through the real
control plane (DeploymentManager, PoolManager with real worker processes, the router over their Unix
sockets, its KServe v2 frontend), then:

  1. first plan: closed-loop clients (``--callers``, grpc.aio, one row per request, pre-serialized
     ModelInferRequest) for ``--duration`` s each: throughput and p99;
  2. calibration: the replanner looks at what serving measured (twice: the first look opens the
     window) and re-places the model if its p99 or rate left the plan; the calibrated plan is printed;
  3. calibrated plan: the same load again.

Goal: the first plan within 20% of the calibrated plan's throughput and p99 at each load.

    .venv/bin/python bench/inference_router_first_plan.py
    .venv/bin/python bench/inference_router_first_plan.py --callers 8 --duration 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import yaml
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2_grpc

from opml_common.config import PlatformSettings, ServiceSettings
from opml_common.grpc.server import GrpcServer
from opml_common.metrics import ServiceMetrics
from opml_inference_router.control import DeploymentManager, Observer, PoolManager, Source
from opml_inference_router.frontend import InferenceFrontend
from opml_inference_router.kserve import encode_request
from opml_inference_router.placement import FleetConfig, ModelVersion
from opml_inference_router.routing import Router
from opml_inference_router.routing.uds_replica import connect
from opml_inference_router.testing import mlp_classifier, mlp_config, write_model_dir

TOKEN = "bench-worker-token"
FLEET = {"pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 4096, "slots": 4, "cost_per_hour": 1.0,
                         "execution_provider": "CPUExecutionProvider"}],
         "pools": [{"name": "cpu", "kind": "cpu", "workers": 2}]}


async def closed_loop(target: str, callers: int, duration_s: float) -> tuple[float, float]:
    """(requests/s, p99 ms) of ``callers`` closed-loop clients for ``duration_s`` after a short warm-up."""
    request = encode_request("mlp", {"features": np.ones((1, 16), np.float32)})
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(50):
            await stub.ModelInfer(request)
        stop = time.perf_counter() + duration_s

        async def caller() -> None:
            while time.perf_counter() < stop:
                began = time.perf_counter()
                await stub.ModelInfer(request)
                latencies.append((time.perf_counter() - began) * 1000)
        began = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(callers)))
        elapsed = time.perf_counter() - began
    return len(latencies) / elapsed, float(np.percentile(latencies, 99))


def describe(manager: DeploymentManager) -> str:
    placed = manager.plan.placements[ModelVersion("mlp", 1)]
    option = placed.option
    return (f"batch cap {option.max_batch}, {len(placed.workers)} replica(s), predicted p99 "
            f"{option.predicted_p99_ms:.2f} ms at {placed.rate_rps:.0f} rps")


async def run(work: Path, args: argparse.Namespace) -> None:
    levels = [int(level) for level in args.callers.split(",")]
    (work / "fleet.yaml").write_text(yaml.safe_dump(FLEET))
    config = {**mlp_config("mlp", pool_kinds=("cpu",), precisions=("fp32",), p99_ms=args.slo_ms),
              "expected_rate_rps": args.rate}
    model_dir = write_model_dir(work / "mlp", config, mlp_classifier(width=64, seed=1))
    metrics = ServiceMetrics("inference-router", registry=CollectorRegistry())
    pools = PoolManager(FleetConfig.from_dict(FLEET), work / "fleet.yaml", work_dir=work, metrics=metrics,
                        token=TOKEN, threads_per_replica=1, route_over_uds=True)
    router = Router(connect=lambda address: connect(address, token=TOKEN), metrics=metrics, rng=random.Random(1))
    manager = DeploymentManager(pools=pools, router=router, observer=Observer(metrics.registry), replan_interval_s=0)
    frontend = InferenceFrontend(router)
    server = GrpcServer(settings=ServiceSettings(host="127.0.0.1", grpc_port=0, metrics_port=0),
                        platform=PlatformSettings(auth_tokens=""), metrics=metrics,
                        registrations=[frontend.registration()])
    async with pools, server:
        await manager.start()
        try:
            await manager.deploy(Source(model_dir=str(model_dir)))
            target = f"127.0.0.1:{server.port}"
            first_plan = describe(manager)
            profile = manager.profiles.get(ModelVersion("mlp", 1), "cpu")
            print(f"# profile (request path), ms per batch: "
                  f"{ {size: round(ms, 3) for size, ms in profile.batch_latency_ms.items()} }")
            await closed_loop(target, 1, 0.2)  # the version's series exist from its first request...
            await manager.replan_once()  # ...so this look opens the replanner's observation window
            first = [await closed_loop(target, level, args.duration) for level in levels]
            replan = await manager.replan_once()
            reasons = "; ".join(replan.reasons.values()) or "no change: serving met the plan"
            calibrated_plan = describe(manager)
            calibrated = [await closed_loop(target, level, args.duration) for level in levels]
        finally:
            await manager.stop()
            await router.close()
    print(f"# first plan: {first_plan}")
    print(f"# replanner: {reasons}")
    print(f"# calibrated plan: {calibrated_plan}")
    print("\n| callers | first plan req/s | p99 ms | calibrated req/s | p99 ms | throughput first/calibrated | "
          "p99 first/calibrated | within 20% |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for level, (rate, p99), (rate_c, p99_c) in zip(levels, first, calibrated):
        ok = rate >= 0.8 * rate_c and p99 <= 1.2 * p99_c
        print(f"| {level} | {rate:.0f} | {p99:.1f} | {rate_c:.0f} | {p99_c:.1f} | {rate / rate_c:.2f} | "
              f"{p99 / p99_c:.2f} | {'yes' if ok else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--callers", default="8,32", help="closed-loop clients per load, comma separated")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per load")
    parser.add_argument("--slo-ms", type=float, default=50.0, help="the model's p99 SLO")
    parser.add_argument("--rate", type=float, default=1000.0, help="the model's expected rate (rps)")
    args = parser.parse_args()
    print(f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; MLP 16-64-64-4, "
          f"SLO p99 {args.slo_ms:g} ms at {args.rate:g} rps expected; {args.duration:g} s per load; "
          f"load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="opml-bench-first-plan-") as work:
        asyncio.run(run(Path(work), args))
    print("# each number is one run of the load (50 warm-up requests excluded)")


if __name__ == "__main__":
    main()
