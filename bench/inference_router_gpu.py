"""Inference-router gpu pool: what a gpu worker serves on its card, fp32 and fp16, beside a cpu worker.

Where this machine has a CUDA device and onnxruntime-gpu (the router's ``gpu`` extra), the router's
own :class:`PoolManager` starts a fleet of one cpu worker and one gpu worker (pinned to the first
device, ``CUDA_VISIBLE_DEVICES``) and each loads an MLP (``--features`` x ``--width`` x ``--depth``)
with a profile: fp32 on cpu, fp32 and fp16 on gpu (fp16 keeps fp32 inputs and outputs). Before it
measures it checks what the test suite cannot without a card: each gpu replica reports Triton's
KIND_GPU and its precision, and answers within fp16's error (2e-2) of the cpu replica on the same
rows; a check that fails exits 1 saying which. It prints the
mean batch latency per batch size from each profile (what placement plans with), then drives each
with closed-loop KServe v2 callers (``--concurrency``, one row each; dynamic batching, max 32) for
``--duration`` s: requests/s, p50 and p99. The first line names the card (nvidia-smi's name).
Where the provider or a device is missing it says which, measures nothing and exits 2.

    .venv/bin/python bench/inference_router_gpu.py
    .venv/bin/python bench/inference_router_gpu.py --width 4096 --depth 4 --concurrency 1,32,128
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import yaml
from prometheus_client import CollectorRegistry
from tritonclient.grpc import model_config_pb2, service_pb2_grpc
from tritonclient.grpc import service_pb2 as pb

from opml_common.gpus import discover
from opml_common.metrics import ServiceMetrics
from opml_inference_router.control import PoolManager
from opml_inference_router.control.pools import unavailable_reasons
from opml_inference_router.kserve import encode_request
from opml_inference_router.placement import FleetConfig
from opml_inference_router.testing import mlp_classifier, mlp_config, write_model_dir

FLEET = {
    "pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 16384, "slots": 2, "cost_per_hour": 0.4,
                    "execution_provider": "CPUExecutionProvider"},
                   {"name": "gpu", "precisions": ["fp32", "fp16"], "memory_mib": 65536, "slots": 2,
                    "cost_per_hour": 2.0, "execution_provider": "CUDAExecutionProvider"}],
    "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}, {"name": "gpu", "kind": "gpu", "workers": 1}],
}
BATCHES = (1, 8, 32)


async def closed_loop(target: str, model: str, concurrency: int, duration_s: float,
                      features: int) -> tuple[float, list[float]]:
    """``concurrency`` callers sending one-row requests back to back; (requests/s, latencies in ms)."""
    rows = np.random.default_rng(0).standard_normal((256, features)).astype(np.float32)
    requests = [encode_request(model, {"features": rows[i:i + 1]}).SerializeToString() for i in range(256)]
    channels = [grpc.aio.insecure_channel(target) for _ in range(min(4, concurrency))]
    calls = [channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=lambda raw: raw,
                                 response_deserializer=pb.ModelInferResponse.FromString) for channel in channels]
    latencies: list[float] = []
    stop_at = 0.0

    async def caller(index: int) -> None:
        sent = index
        while time.perf_counter() < stop_at:
            start = time.perf_counter()
            await calls[index % len(calls)](requests[sent % len(requests)], timeout=30)
            latencies.append((time.perf_counter() - start) * 1000.0)
            sent += 1

    stop_at = time.perf_counter() + 1.0  # warm-up (CUDA kernels, the batcher), not counted
    await asyncio.gather(*(caller(i) for i in range(concurrency)))
    latencies.clear()
    began = time.perf_counter()
    stop_at = began + duration_s
    await asyncio.gather(*(caller(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - began
    for channel in channels:
        await channel.close()
    return len(latencies) / elapsed, latencies


class CheckFailed(Exception):
    """A gpu replica is not what placement counts on (device, precision, answers)."""


async def answers(target: str, model: str, precision: str, rows: np.ndarray) -> np.ndarray:
    """``model``'s answer to ``rows`` at ``target``.

    Raises: CheckFailed unless it runs on its pool kind's device (KIND_GPU on gpu) in ``precision``."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        config = (await stub.ModelConfig(pb.ModelConfigRequest(name=model))).config
        reply = await stub.ModelInfer(encode_request(model, {"features": rows}))
    pool_kind, kind = config.parameters["opml_pool_kind"].string_value, config.instance_group[0].kind
    if (pool_kind == "gpu") != (kind == model_config_pb2.ModelInstanceGroup.KIND_GPU):
        raise CheckFailed(f"{model}: instance group {model_config_pb2.ModelInstanceGroup.Kind.Name(kind)} on "
                          f"pool kind {pool_kind}")
    if config.parameters["opml_precision"].string_value != precision:
        raise CheckFailed(f"{model}: precision {config.parameters['opml_precision'].string_value}, not {precision}")
    return np.frombuffer(reply.raw_output_contents[0], dtype=np.float32)


async def run(work: Path, args: argparse.Namespace) -> int:
    config = FleetConfig.from_dict(FLEET)
    devices = discover()
    missing = unavailable_reasons(config, set(ort.get_available_providers()), devices)
    if "gpu" in missing:
        print(f"# gpu figures not measured: {missing['gpu']}", file=sys.stderr)
        return 2
    (work / "fleet.yaml").write_text(yaml.safe_dump(FLEET))
    model = mlp_classifier(features=args.features, width=args.width, depth=args.depth, classes=10)
    common = {"features": args.features, "classes": 10, "max_batch_size": 32, "max_queue_delay_us": 1000}
    bundles = {name: write_model_dir(work / "models" / name, mlp_config(name, pool_kinds=kinds, precisions=precisions,
                                                                         **common), model)
               for name, kinds, precisions in (("m-cpu", ("cpu",), ("fp32",)), ("m-fp32", ("gpu",), ("fp32",)),
                                               ("m-fp16", ("gpu",), ("fp32", "fp16")))}
    pools = PoolManager(config, work / "fleet.yaml", work_dir=work, devices=devices[:1],
                        metrics=ServiceMetrics("inference-router", registry=CollectorRegistry()))
    gpu = next(w for w in pools.workers() if w.worker.kind.name == "gpu")
    print(f"# {gpu.device.name} ({gpu.device.memory_mib} MiB), onnxruntime {ort.__version__}; MLP {args.features}-"
          f"{'-'.join([str(args.width)] * args.depth)}-10; dynamic batching max 32, delay 1000 us; "
          f"{args.duration:g} s per level")
    async with pools:
        placed = {"m-cpu": ("cpu-000", "fp32"), "m-fp32": ("gpu-000", "fp32"), "m-fp16": ("gpu-000", "fp16")}
        print("\n| model | kind | precision | " + " | ".join(f"batch {b} ms" for b in BATCHES) + " |")
        print("|---|---|---|" + "---:|" * len(BATCHES))
        for name, (worker, precision) in placed.items():
            client = pools.client(worker)
            await client.load(name, path=bundles[name], version=1, precision=precision, profile=True)
            profile = await client.profile(name, 1)
            cells = " | ".join(f"{profile.latency_ms(b):.3f}" for b in BATCHES)
            print(f"| {name} | {worker.split('-')[0]} | {precision} | {cells} |")
        rows = np.random.default_rng(1).standard_normal((8, args.features)).astype(np.float32)
        got = {name: await answers(pools.get(worker).process.target, name, precision, rows)
               for name, (worker, precision) in placed.items()}
        for name in ("m-fp32", "m-fp16"):
            if not np.allclose(got[name], got["m-cpu"], rtol=2e-2, atol=2e-2):
                worst = float(np.max(np.abs(got[name] - got["m-cpu"])))
                raise CheckFailed(f"{name}: answers differ from the cpu replica's by up to {worst:.4f}")
        print("\n| model | callers | requests/s | p50 ms | p99 ms |")
        print("|---|---:|---:|---:|---:|")
        for name, (worker, _) in placed.items():
            for level in (int(c) for c in args.concurrency.split(",")):
                rate, latencies = await closed_loop(pools.get(worker).process.target, name, level, args.duration,
                                                    args.features)
                p99 = float(np.percentile(latencies, 99))
                print(f"| {name} | {level} | {rate:.0f} | {statistics.median(latencies):.2f} | {p99:.2f} |")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--concurrency", default="1,16,64", help="closed-loop callers, comma separated")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds measured per level")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="opml-bench-gpu-") as work:
        try:
            code = asyncio.run(run(Path(work), args))
        except CheckFailed as failure:
            print(f"# check failed: {failure}", file=sys.stderr)
            code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
