"""Inference router vs its peers: throughput at equal p99, same ONNX model, same cores.

One ONNX MLP (``--features`` x ``--width`` x ``--depth``, dynamic batch dimension, fp32) is served by:

  ours/router  the router in its own process (KServe v2 frontend, Router, one UdsReplica per worker:
               the workers' Unix sockets, as the pool manager wires them) over worker processes, at
               each ``--replicas`` setting (the comparison takes the best, as for MLServer), dynamic
               batching (max 32, ``--delay-ms``);
  ours/router (gRPC hop)  the same router reaching the same workers over gRPC/TCP (GrpcReplica), as it
               reaches workers on other machines;
  ours/direct  the same workers called directly, clients spread over them (a reference: no router hop);
  MLServer     1.7.1 with a custom onnxruntime runtime (bench/_mlserver_onnx_runtime.py), adaptive
               batching (max 32, ``--delay-ms``), KServe v2 gRPC, at each ``--mlserver-workers``
               setting (``parallel_workers``: 0 runs inference in the server process itself); the
               comparison takes MLServer's best setting at each latency bound;
  Ray Serve    2.60 (bench/_ray_serve_peer.py), ``@serve.batch`` (max 32, ``--delay-ms``),
               the largest ``--replicas`` setting's replicas on a local Ray cluster of as many CPUs, HTTP.

Every model replica gets ``--threads`` intra-op threads and no spinning. The peers live in their
own venvs (.venv-peers-mlserver, .venv-peers-ray, created from bench/requirements-peers-*.txt when
missing: their pins clash with each other and with the project's). One load generator, this
process, drives them in turn: closed-loop clients sending one row per request (ours and MLServer:
``--client tritonclient``, tritonclient's aio client building each request as a KServe user's code
does, or ``--client raw``, the same pre-serialized ModelInferRequest over grpc.aio; Ray: the row's
raw float32 bytes in an HTTP POST over aiohttp, lighter than any KServe message), ``--concurrency``
levels of ``--duration`` s after a warm-up. Each system's answer is checked against onnxruntime
first. The CPU time (user + system, from /proc through psutil) of each system's serving processes,
their children included, is read around every level: requests per CPU-second says what each serves
for the cores it takes, which on two cores shared with the load generator is what throughput alone
cannot show. For each ``--p99-ms`` bound it reports each system's best throughput whose p99 stays
within it, its requests per CPU-second at that level, and ours/peer ratios of both.

    .venv/bin/python bench/inference_router_peers.py
    .venv/bin/python bench/inference_router_peers.py --concurrency 1,8,32 --duration 2 --replicas 1
    .venv/bin/python bench/inference_router_peers.py --systems ours,mlserver --client tritonclient \
        --width 512 --depth 2 --features 256 --mlserver-workers 0,1,2 --replicas 1,2 --paths router
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import onnxruntime as ort
import psutil
import tritonclient.grpc.aio as triton
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from opml_devstack.devinfra import free_port
from opml_inference_router.kserve import decode_response, encode_request
from opml_inference_router.testing import mlp_classifier, mlp_config, write_model_dir
from opml_inference_router.worker.process import WorkerProcess

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
FLEET = REPO / "services" / "inference-router" / "examples" / "fleet.yaml"
MODEL = "peer-mlp"
INFER = "/inference.GRPCInferenceService/ModelInfer"
ROWS = 256  # distinct request rows, cycled
CLASSES = 10


def peer_python(peer: str) -> Path:
    """The peer's venv interpreter, creating the venv from its pinned requirements when missing."""
    venv = REPO / f".venv-peers-{peer}"
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"# creating {venv.name} from bench/requirements-peers-{peer}.txt (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-r",
                        str(BENCH / f"requirements-peers-{peer}.txt")], check=True)
    return python


def start(args: list[str], log: Path, *, env: dict[str, str] | None = None, cwd: Path | None = None,
          announce: bool = True, timeout_s: float = 180.0) -> tuple[subprocess.Popen, dict]:
    """Start a server in its own process group; with ``announce``, wait for its first stdout line (JSON)."""
    with open(log, "ab") as log_file:
        process = subprocess.Popen(args, stdout=subprocess.PIPE if announce else log_file,
                                   stderr=log_file, stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True,
                                   env={**os.environ, **(env or {})})
    if not announce:
        return process, {}
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    line = process.stdout.readline() if ready else b""
    if not line:
        stop(process)
        raise RuntimeError(f"{args[:3]} did not start:\n{log.read_text()[-3000:]}")
    return process, json.loads(line)


def stop(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the server (it stops its own workers: Ray Serve its actors, MLServer its pool), then
    SIGKILL whatever is left of its process group."""
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


async def serve_router(workers: list[str], bundle: Path, hedge: bool, native: bool) -> None:
    """The router as its own process (``--serve-router``): frontend + Router over the workers
    (``uds:<path>`` over their Unix sockets, ``host:port`` over gRPC); with ``native``, also its
    native inference front (a child process), whose port is announced as ``inference_port``."""
    from opml_common.config import PlatformSettings, ServiceSettings
    from opml_common.grpc.server import GrpcServer, wait_for_signal
    from opml_common.metrics import ServiceMetrics
    from opml_inference_router.frontend import InferenceFrontend
    from opml_inference_router.native_front import FrontLink, NativeFront
    from opml_inference_router.routing import ModelPolicy, Router
    from opml_inference_router.routing.uds_replica import connect
    from opml_inference_router_contract.model_config import load_model_config

    metrics = ServiceMetrics("inference-router")
    router = Router(connect=connect, metrics=metrics)
    router.set_model(MODEL, ModelPolicy.for_model(load_model_config(bundle / "model.yaml"), replicas=len(workers),
                                                  hedge=hedge))
    for worker in workers:
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


def mlserver_repository(root: Path, onnx_path: Path, args: argparse.Namespace, workers: int) -> int:
    """MLServer's settings.json (``parallel_workers`` = ``workers``) and model-settings.json; returns the gRPC port."""
    grpc_port = free_port()
    (root / "settings.json").write_text(json.dumps({
        "debug": False, "parallel_workers": workers, "host": "127.0.0.1", "http_port": free_port(),
        "grpc_port": grpc_port, "metrics_port": free_port()}))
    (root / MODEL).mkdir()
    (root / MODEL / "model-settings.json").write_text(json.dumps({
        "name": MODEL, "implementation": "_mlserver_onnx_runtime.OnnxRuntime",
        "max_batch_size": args.max_batch, "max_batch_time": args.delay_ms / 1000.0,
        "parameters": {"uri": str(onnx_path), "extra": {"intra_op_threads": args.threads}}}))
    return grpc_port


def wait_model_ready(target: str, process: subprocess.Popen, log: Path, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if stub.ModelReady(pb.ModelReadyRequest(name=MODEL), timeout=2).ready:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"{target} never served {MODEL}:\n{log.read_text()[-3000:]}")


Send = Callable[[int, int], Awaitable[object]]  # (client, request number) -> the response


class CpuMeter:
    """CPU seconds (user + system) used so far by ``pids`` and their children, from /proc via psutil.

    Children are found at every reading (MLServer's inference pool, Ray's actors); one that exited
    between two readings takes its time with it, so read around short windows."""

    def __init__(self, pids: list[int]) -> None:
        self.roots = [psutil.Process(pid) for pid in pids]

    def seconds(self) -> float:
        total = 0.0
        for root in self.roots:
            with contextlib.suppress(psutil.NoSuchProcess):
                for process in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        times = process.cpu_times()
                        total += times.user + times.system
        return total


class GrpcTarget:
    """KServe v2 ModelInfer over grpc.aio, requests pre-serialized; clients spread over ``targets``."""

    def __init__(self, targets: list[str], rows: np.ndarray) -> None:
        self.targets = targets
        self.requests = [encode_request(MODEL, {"features": rows[i:i + 1]}).SerializeToString()
                         for i in range(len(rows))]

    async def __aenter__(self) -> Send:
        self.channels = [grpc.aio.insecure_channel(target) for _ in range(2) for target in self.targets]
        calls = [channel.unary_unary(INFER) for channel in self.channels]

        async def send(client: int, number: int) -> bytes:
            return await calls[client % len(calls)](self.requests[number % len(self.requests)], timeout=30)
        return send

    async def __aexit__(self, *_: object) -> None:
        for channel in self.channels:
            await channel.close()

    @staticmethod
    def scores(response: bytes) -> np.ndarray:
        return decode_response(pb.ModelInferResponse.FromString(response))["scores"]


class TritonTarget:
    """tritonclient's aio client, an InferInput built per request from the row (what a KServe user's
    code does); two clients (channels) per target, callers spread over them."""

    def __init__(self, targets: list[str], rows: np.ndarray) -> None:
        self.targets = targets
        self.rows = rows

    async def __aenter__(self) -> Send:
        self.clients = [triton.InferenceServerClient(target) for _ in range(2) for target in self.targets]

        async def send(client: int, number: int) -> triton.InferResult:
            row = self.rows[number % len(self.rows)][None, :]
            tensor = triton.InferInput("features", list(row.shape), "FP32")
            tensor.set_data_from_numpy(row)
            return await self.clients[client % len(self.clients)].infer(MODEL, [tensor], client_timeout=30)
        return send

    async def __aexit__(self, *_: object) -> None:
        for client in self.clients:
            await client.close()

    @staticmethod
    def scores(response: triton.InferResult) -> np.ndarray:
        return response.as_numpy("scores")


class HttpTarget:
    """One raw float32 row per HTTP POST over aiohttp (keep-alive connections)."""

    def __init__(self, url: str, rows: np.ndarray) -> None:
        self.url = url
        self.bodies = [rows[i:i + 1].tobytes() for i in range(len(rows))]

    async def __aenter__(self) -> Send:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=30))

        async def send(client: int, number: int) -> bytes:
            async with self.session.post(self.url, data=self.bodies[number % len(self.bodies)],
                                         headers={"content-type": "application/octet-stream"}) as response:
                response.raise_for_status()
                return await response.read()
        return send

    async def __aexit__(self, *_: object) -> None:
        await self.session.close()

    @staticmethod
    def scores(response: bytes) -> np.ndarray:
        return np.frombuffer(response, dtype=np.float32).reshape(1, -1)


Level = tuple[int, float, float, float, float]  # clients, inferences/s, p50 ms, p99 ms, inferences per CPU-second


async def sweep(target: GrpcTarget | TritonTarget | HttpTarget, levels: list[int], duration_s: float,
                warmup_s: float, expected: np.ndarray, label: str, meter: CpuMeter) -> list[Level]:
    """Check one answer, then closed-loop clients per level: (clients, inferences/s, p50 ms, p99 ms,
    inferences per CPU-second of the serving processes)."""
    results = []
    async with target as send:
        got = target.scores(await send(0, 0))
        if not np.allclose(got, expected[:1], atol=1e-4):
            raise AssertionError(f"{label} answered {got} for row 0, onnxruntime {expected[:1]}")
        for level in levels:
            latencies: list[float] = []
            stop_at = 0.0

            # The clients read this iteration's stop_at, latencies and level late on purpose: stop_at
            # moves from the warm-up's end to the measurement's while they run, within the iteration.
            async def client(index: int) -> None:
                number = index
                while time.perf_counter() < stop_at:  # noqa: B023
                    began = time.perf_counter()
                    await send(index, number)
                    latencies.append((time.perf_counter() - began) * 1000.0)  # noqa: B023
                    number += level  # noqa: B023

            stop_at = time.perf_counter() + warmup_s
            await asyncio.gather(*(client(i) for i in range(level)))
            latencies.clear()
            cpu_before = meter.seconds()
            began = time.perf_counter()
            stop_at = began + duration_s
            await asyncio.gather(*(client(i) for i in range(level)))
            rate = len(latencies) / (time.perf_counter() - began)
            per_cpu_s = len(latencies) / max(meter.seconds() - cpu_before, 1e-9)
            ordered = sorted(latencies)
            results.append((level, rate, statistics.median(ordered), ordered[int(0.99 * (len(ordered) - 1))],
                            per_cpu_s))
            print(f"| {label} | {level} | {rate:.0f} | {results[-1][2]:.2f} | {results[-1][3]:.2f} | "
                  f"{per_cpu_s:.0f} |", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--replicas", default="2",
                        help="model replicas (worker processes) of ours, comma separated settings; Ray gets the largest")
    parser.add_argument("--paths", default="native,router,grpc-hop,direct",
                        help="which of ours to measure: native (the router's native inference front), router (its "
                             "Python gRPC port), both over the workers' Unix sockets; grpc-hop (Python port, gRPC to "
                             "the workers); direct (the workers' own gRPC) (comma separated)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per replica")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--delay-ms", type=float, default=2.0, help="batching: longest wait for a fuller batch")
    parser.add_argument("--concurrency", default="1,2,4,6,8,12,16,24,32", help="closed-loop clients, comma separated")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds measured per level")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds of load before each level")
    parser.add_argument("--p99-ms", default="20,50,100", help="latency bounds, comma separated")
    parser.add_argument("--systems", default="ours,mlserver,ray", help="which to run, comma separated")
    parser.add_argument("--client", choices=("tritonclient", "raw"), default="tritonclient",
                        help="KServe load generator for ours and MLServer: tritonclient's aio client, or "
                             "pre-serialized requests over grpc.aio (lighter)")
    parser.add_argument("--mlserver-workers", default="0,1,2",
                        help="MLServer parallel_workers settings to measure, comma separated (0: in-process)")
    parser.add_argument("--no-hedge", action="store_true", help="router without backup requests (on by default)")
    parser.add_argument("--serve-router", nargs=2, metavar=("WORKERS", "BUNDLE"), help=argparse.SUPPRESS)
    parser.add_argument("--native-front", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_router:
        asyncio.run(serve_router(args.serve_router[0].split(","), Path(args.serve_router[1]), not args.no_hedge,
                                 args.native_front))
        return
    systems = args.systems.split(",")
    pythons = {peer: peer_python(peer) for peer in ("mlserver", "ray") if peer in systems}
    with tempfile.TemporaryDirectory(prefix="opml-bench-peers-") as tmp:
        results = run(Path(tmp), args, systems, pythons)
    report(results, args)


def run(work: Path, args: argparse.Namespace, systems: list[str],
        pythons: dict[str, Path]) -> dict[str, list[Level]]:
    levels = [int(level) for level in args.concurrency.split(",")]
    model = mlp_classifier(features=args.features, width=args.width, depth=args.depth, classes=CLASSES)
    config = mlp_config(MODEL, features=args.features, classes=CLASSES, max_batch_size=args.max_batch,
                        max_queue_delay_us=int(args.delay_ms * 1000), pool_kinds=("cpu",), precisions=("fp32",))
    bundle = write_model_dir(work / MODEL, config, model)
    onnx_path = bundle / "model.onnx"
    rows = np.random.default_rng(0).standard_normal((ROWS, args.features)).astype(np.float32)
    expected = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(None, {"features": rows})[0]
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores (load generator on them too); "
          f"MLP {args.features}-{'-'.join([str(args.width)] * args.depth)}-{CLASSES} fp32, one row per request; "
          f"{args.replicas} replica(s) of ours x {args.threads} intra-op thread(s); batching max {args.max_batch}, "
          f"{args.delay_ms:g} ms; {args.duration:g} s per level after {args.warmup:g} s warm-up", flush=True)
    print(f"# KServe load generator: {args.client}", flush=True)
    print("\n| system | clients | inferences/s | p50 ms | p99 ms | inferences per CPU-s |\n"
          "|---|---:|---:|---:|---:|---:|", flush=True)
    results: dict[str, list[Level]] = {}
    kserve = TritonTarget if args.client == "tritonclient" else GrpcTarget

    def measure(target: GrpcTarget | TritonTarget | HttpTarget, label: str, pids: list[int]) -> list[Level]:
        return asyncio.run(sweep(target, levels, args.duration, args.warmup, expected, label, CpuMeter(pids)))

    counts = [int(count) for count in args.replicas.split(",")]
    paths = args.paths.split(",")
    with ExitStack() as servers:
        for count in (counts if "ours" in systems else []):
            suffix = f" x{count}" if len(counts) > 1 else ""
            workers, sockets, worker_pids = [], [], []
            for index in range(count):
                worker = WorkerProcess("cpu", FLEET, work / f"worker-{index}.log", env={"OPML_LOG_LEVEL": "WARNING"},
                                       extra_args=("--threads-per-replica", str(args.threads)),
                                       uds=work / f"worker-{index}.sock")
                servers.callback(worker.stop)
                worker.start()
                with grpc.insecure_channel(worker.target) as channel:
                    load = pb.RepositoryModelLoadRequest(model_name=MODEL)
                    load.parameters["path"].string_param = str(bundle)
                    service_pb2_grpc.GRPCInferenceServiceStub(channel).RepositoryModelLoad(load, timeout=120)
                workers.append(worker.target)
                sockets.append(worker.local_target)
                worker_pids.append(worker.process.pid)
            for path, label, addresses in (("native", "ours/native front", sockets), ("router", "ours/router", sockets),
                                           ("grpc-hop", "ours/router (gRPC hop)", workers)):
                if path not in paths:
                    continue
                label += suffix
                router, announced = start([sys.executable, __file__, "--serve-router", ",".join(addresses), str(bundle),
                                           *(["--no-hedge"] if args.no_hedge else []),
                                           *(["--native-front"] if path == "native" else [])],
                                          work / f"router-{len(results)}.log")
                servers.callback(stop, router)
                port = announced["inference_port" if path == "native" else "grpc_port"]
                # the native front is the router's child: CpuMeter counts it with the router
                results[label] = measure(kserve([f"127.0.0.1:{port}"], rows), label, [router.pid, *worker_pids])
                stop(router)
            if "direct" in paths:
                results[f"ours/direct{suffix}"] = measure(kserve(workers, rows), f"ours/direct{suffix}", worker_pids)
            servers.close()
        for setting in (int(workers) for workers in args.mlserver_workers.split(",") if "mlserver" in systems):
            root, log = work / f"mlserver-{setting}", work / f"mlserver-{setting}.log"
            root.mkdir()
            port = mlserver_repository(root, onnx_path, args, setting)
            mlserver, _ = start([str(pythons["mlserver"].parent / "mlserver"), "start", str(root)],
                                log, env={"PYTHONPATH": str(BENCH)}, announce=False)
            servers.callback(stop, mlserver)
            wait_model_ready(f"127.0.0.1:{port}", mlserver, log)
            label = f"MLServer ({setting} parallel workers)" if setting else "MLServer (in-process)"
            results[label] = measure(kserve([f"127.0.0.1:{port}"], rows), label, [mlserver.pid])
            servers.close()
        if "ray" in systems:
            ray, announced = start([str(pythons["ray"]), str(BENCH / "_ray_serve_peer.py"), "--model", str(onnx_path),
                                    "--port", str(free_port()), "--replicas", str(max(counts)),
                                    "--threads", str(args.threads), "--max-batch", str(args.max_batch),
                                    "--wait-s", str(args.delay_ms / 1000.0), "--temp-dir", str(work / "ray")],
                                   work / "ray.log", env={"RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0"})
            servers.callback(stop, ray)
            results["Ray Serve (HTTP)"] = measure(HttpTarget(f"http://127.0.0.1:{announced['http_port']}/", rows),
                                                  "Ray Serve (HTTP)", [ray.pid])
    return results


def report(results: dict[str, list[Level]], args: argparse.Namespace) -> None:
    """Per latency bound: each system's best throughput within it and its inferences per CPU-second
    at that level; each system's settings (MLServer's workers, our replica counts) are folded into its
    best one per bound (by throughput; per CPU-s is that setting's); ours ÷ peers, best against best."""
    bounds = [float(bound) for bound in args.p99_ms.split(",")]

    def best(rows: list[Level], bound: float) -> tuple[float, float]:
        return max(((rate, per_cpu) for _, rate, _, tail, per_cpu in rows if tail <= bound), default=(0.0, 0.0))
    table = {name: [best(rows, bound) for bound in bounds] for name, rows in results.items()}
    groups: dict[str, list[str]] = {}
    for name in table:
        groups.setdefault("MLServer" if name.startswith("MLServer") else name.split(" x")[0], []).append(name)
    folded = {group: names for group, names in groups.items() if len(names) > 1}
    for group, names in folded.items():
        table[f"{group} (best setting)"] = [max((table[name][i] for name in names), default=(0.0, 0.0))
                                            for i in range(len(bounds))]
    settings = {name for names in folded.values() for name in names}
    print("\n| best inferences/s (per CPU-s) with p99 <= | " + " | ".join(f"{bound:g} ms" for bound in bounds) + " |")
    print("|---|" + "---:|" * len(bounds))
    for name, cells in table.items():
        print(f"| {name} | " + " | ".join(f"{rate:.0f} ({per_cpu:.0f})" for rate, per_cpu in cells) + " |")
    peers = [name for name in table if not name.startswith("ours") and name not in settings]
    for mine in (name for name in table if name.startswith("ours") and name not in settings):
        for peer in peers:
            print(f"| {mine} ÷ {peer} | " + " | ".join(
                f"{ours[0] / theirs[0]:.2f}x ({ours[1] / theirs[1]:.2f}x)" if theirs[0] and theirs[1] else "n/a"
                for ours, theirs in zip(table[mine], table[peer])) + " |")
    client = ("tritonclient's aio client, a request built per call" if args.client == "tritonclient"
              else "the same pre-serialized request bytes over grpc.aio")
    print(f"\nours and MLServer: KServe v2 gRPC, {client}; Ray Serve: HTTP/1.1 with the raw float32 row as the "
          "body (no KServe encoding), so its protocol is the lighter one. Per CPU-s: inferences per CPU-second "
          "of the system's serving processes (router and workers; MLServer and its pool) over the same level.")

if __name__ == "__main__":
    main()
