"""Serving as a user meets it: the router as `make up` runs it against MLServer, arms alternated.

The router runs as its service process (its default fleet: two CPU workers, so N+1 places the model's
two replicas on distinct workers; the prediction log on, publishing to the embedded broker; auth on),
and the model is deployed as ``opml model deploy`` does it (DeploymentService.Deploy of a model
directory). The model: MLP 256-512-512-10, dynamic batching up to 32 rows with a 2 ms queue delay,
SLO p99 50 ms. MLServer 1.7.1 serves the same ONNX file in its own venv (bench/_mlserver_onnx_runtime.py,
.venv-peers-mlserver) at its best setting: every ``--mlserver-settings`` (``parallel_workers``, adaptive
batching on or off) is measured first at each caller count, and at each caller count the rounds use the
setting best there (the better sum of its ranks by req/s and by p99; the chosen ones run side by side,
idle but for their turn).

One load generator, this process: tritonclient's aio client (one client per system, an InferInput
built per request, one row, a 5 s client deadline), closed-loop callers. Per round and caller count
the two systems take turns (the order flips each time), each ``--warmup`` s then ``--duration`` s.
Reported per system and caller count: req/s and p50/p99 of the calls that succeeded (their range over
the rounds, and the p99 of all rounds' latencies pooled), failed calls by status code (the router's
admission refuses with RESOURCE_EXHAUSTED what it expects to miss the model's SLO), and CPU seconds per
1,000 answered requests of the server's whole process tree (router, native front, workers; MLServer and
its pool), read from /proc (psutil).

Ours runs twice by default (``--direct both``): as before, every call through the router's event loop,
and a second router with the direct data plane on (OPML_INFERENCE_ROUTER_DIRECT_DATA_PLANE: the native
front sends a call straight to a worker and reports it to the router afterwards); the three arms take
turns, each first in turn, and the report compares each of ours with MLServer and the direct one with
the other.

Where the time goes, for ours: the router's /metrics (its own and its workers') read around each
level give the mean time in the router (admission to answer), in the worker's batcher (queue wait +
run), the batch size, backups sent, predictions published; CPU per 1,000 requests by process. With
``--profile DIR`` the router's Python processes are sampled with py-spy (``.venv``'s, the
``profile`` extra) at ``--profile-callers`` in the last round, and each one's hottest frames printed.

    .venv/bin/python bench/inference_router_tail.py
    .venv/bin/python bench/inference_router_tail.py --rounds 3 --duration 8 --profile /tmp/tail-profile
    .venv/bin/python bench/inference_router_tail.py --mlserver-settings 0:on --rounds 1   # a quick look
    .venv/bin/python bench/inference_router_tail.py --callers 1 --rounds 3 --busy-loops 3  # beside busy loops

``--busy-loops N`` runs N processes that only spin for the whole bench (the machine's other work, the
same for every arm: how each system holds up when it must share the cores).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import psutil
import tritonclient.grpc.aio as triton
from _stack import bench_services
from inference_router_peers import peer_python, start, stop
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from opml_devstack.devinfra import free_port
from opml_devstack.testing.services import TOKENS
from opml_inference_router.testing import mlp_classifier, mlp_config, write_model_dir
from opml_inference_router_contract.client import DeploymentClient

BENCH = Path(__file__).resolve().parent
MODEL = "tail-mlp"
FEATURES, WIDTH, DEPTH, CLASSES = 256, 512, 2, 10
MAX_BATCH, DELAY_MS, SLO_P99_MS = 32, 2.0, 50.0
ROWS = 256
INFERENCE_TOKEN = "bench-inference-token"
OURS, DIRECT, PEER = "ours (native front :8001)", "ours, direct data plane", "MLServer"
DEADLINE_S = 5.0


@dataclass
class Level:
    """One system's measurement at one caller count in one round."""

    callers: int
    rate: float
    p50_ms: float
    p99_ms: float
    cpu_per_1000_s: float
    errors: int
    latencies_ms: list[float] = field(repr=False)
    infra_per_1000_s: float = 0.0  # the broker, its S3 server, Redis: CPU s per 1,000 requests
    codes: dict[str, int] = field(default_factory=dict)  # failed calls by status code
    by_process: dict[str, float] = field(default_factory=dict)  # process label -> CPU s per 1,000
    stages: dict[str, float] = field(default_factory=dict)  # ours: from the router's /metrics


class ProcessTree:
    """CPU seconds (user + system) of a server process and every descendant, per process, from /proc."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)

    def seconds(self) -> dict[int, tuple[str, float]]:
        out = {}
        for process in [self.root, *self.root.children(recursive=True)]:
            try:
                times = process.cpu_times()
                out[process.pid] = (_label(process), times.user + times.system)
            except psutil.NoSuchProcess:
                continue
        return out


def _label(process: psutil.Process) -> str:
    command = " ".join(process.cmdline())
    if "opml-inference-front" in command:
        return "native front"
    if "opml_inference_router.worker" in command:
        return "worker"
    if "opml_inference_router" in command:
        return "router"
    if "mlserver" in command and process.name() != "python":
        return "MLServer"
    return "MLServer worker" if "mlserver" in command or "multiprocessing" in command else process.name()


INFRA = ("tansu", "weed", "redis-server")
"""The embedded infrastructure's processes (this bench's children): the broker the prediction log
publishes to, the S3 server the broker stores in, Redis."""


def infra_seconds() -> float:
    """CPU seconds of the embedded infrastructure so far (not in either server's tree: the cost of the
    prediction log's records, reported beside ours)."""
    total = 0.0
    for process in psutil.Process().children(recursive=True):
        try:
            if any(name in process.name() for name in INFRA):
                times = process.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds by process label between two readings (processes that exited are lost)."""
    used: dict[str, float] = collections.defaultdict(float)
    for pid, (label, seconds) in after.items():
        used[label] += seconds - before.get(pid, (label, 0.0))[1]
    return dict(used)


class Scrape:
    """The router's /metrics (its own families and its workers', which it re-exports) as summed samples."""

    NAMES = {
        "router_s": "opml_inference_router_request_duration_seconds",
        "worker_s": "opml_inference_router_worker_inference_duration_seconds",
        "batch_rows": "opml_inference_router_worker_batch_size",
    }
    COUNTERS = {
        "backups": "opml_inference_router_backup_requests_total",
        "published": "opml_inference_router_predictions_published_total",
        "dropped": "opml_inference_router_predictions_dropped_total",
    }

    def __init__(self, url: str) -> None:
        self.url = url

    def read(self) -> dict[str, float]:
        text = urllib.request.urlopen(self.url, timeout=10).read().decode()  # noqa: S310 - a local bench URL
        values: dict[str, float] = collections.defaultdict(float)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for key, name in self.NAMES.items():
                    if sample.name == f"{name}_bucket" and sample.labels.get("le") == "0.025":
                        values[f"{key}_fast"] += sample.value
                    elif sample.name == f"{name}_sum":
                        values[f"{key}_sum"] += sample.value
                    elif sample.name == f"{name}_count":
                        values[f"{key}_count"] += sample.value
                for key, name in self.COUNTERS.items():
                    if sample.name == name:
                        values[key] += sample.value
        return values

    @staticmethod
    def stages(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        def mean(key: str) -> float:
            count = after[f"{key}_count"] - before[f"{key}_count"]
            return (after[f"{key}_sum"] - before[f"{key}_sum"]) / count if count else float("nan")
        def slow(key: str) -> float:  # per 1,000 requests, those over 25 ms (the histograms' bucket edge)
            count = after[f"{key}_count"] - before[f"{key}_count"]
            fast = after[f"{key}_fast"] - before[f"{key}_fast"]
            return (count - fast) / count * 1000 if count else float("nan")
        return {"router_ms": mean("router_s") * 1000, "worker_ms": mean("worker_s") * 1000,
                "router_slow": slow("router_s"), "worker_slow": slow("worker_s"),
                "batch_rows": mean("batch_rows"), "backups": after["backups"] - before["backups"],
                "published": after["published"] - before["published"],
                "dropped": after["dropped"] - before["dropped"]}


class System:
    """A server to measure: its inference target, auth headers, process tree and (ours) metrics URL."""

    def __init__(self, name: str, target: str, pid: int, headers: dict[str, str] | None = None,
                 scrape: Scrape | None = None) -> None:
        self.name, self.target, self.headers, self.scrape = name, target, headers, scrape
        self.tree = ProcessTree(pid)
        self.client: triton.InferenceServerClient | None = None


async def measure(system: System, rows: np.ndarray, callers: int, warmup_s: float, duration_s: float,
                  profile: Path | None = None) -> Level:
    """``callers`` closed-loop callers on ``system`` for ``warmup_s`` then ``duration_s``."""
    client = system.client
    assert client is not None
    latencies: list[float] = []
    errors = 0
    codes: collections.Counter[str] = collections.Counter()
    stop_at = 0.0
    recording = True

    async def caller(index: int) -> None:
        nonlocal errors
        number = index
        while time.perf_counter() < stop_at:
            row = rows[number % len(rows)][None, :]
            tensor = triton.InferInput("features", list(row.shape), "FP32")
            tensor.set_data_from_numpy(row)
            began = time.perf_counter()
            try:
                await client.infer(MODEL, [tensor], headers=system.headers, client_timeout=DEADLINE_S)
            except triton.InferenceServerException as exc:
                errors += recording
                codes[str(exc.status()).removeprefix("StatusCode.")] += recording
            else:
                if recording:
                    latencies.append((time.perf_counter() - began) * 1000.0)
            number += callers

    recording = False
    stop_at = time.perf_counter() + warmup_s
    await asyncio.gather(*(caller(i) for i in range(callers)))
    recording = True
    scraped = system.scrape.read() if system.scrape else None
    cpu_before, infra_before = system.tree.seconds(), infra_seconds()
    samplers = start_profiles(system, duration_s, profile) if profile else []
    began = time.perf_counter()
    stop_at = began + duration_s
    await asyncio.gather(*(caller(i) for i in range(callers)))
    elapsed = time.perf_counter() - began
    by_process = cpu_delta(cpu_before, system.tree.seconds())
    infra = infra_seconds() - infra_before
    for sampler in samplers:
        sampler.wait(60)
    stages = Scrape.stages(scraped, system.scrape.read()) if system.scrape and scraped else {}
    done = max(len(latencies), 1)
    ordered = sorted(latencies) or [float("nan")]
    return Level(callers, len(latencies) / elapsed, statistics.median(ordered),
                 ordered[int(0.99 * (len(ordered) - 1))], sum(by_process.values()) / done * 1000, errors, latencies,
                 infra / done * 1000, {k: v for k, v in codes.items() if v},
                 {label: seconds / done * 1000 for label, seconds in by_process.items()}, stages)


def start_profiles(system: System, duration_s: float, directory: Path) -> list[subprocess.Popen]:
    """py-spy on each Python process of ``system``'s tree for ``duration_s`` (collapsed stacks)."""
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        raise SystemExit(f"--profile needs py-spy: .venv/bin/python -m pip install -c constraints.txt "
                         f"-e 'services/inference-router[profile]' ({spy} is missing)")
    directory.mkdir(parents=True, exist_ok=True)
    samplers = []
    for pid, (label, _seconds) in system.tree.seconds().items():
        if label == "native front":
            continue
        out = directory / f"{label.replace(' ', '-')}-{pid}.txt"
        samplers.append(subprocess.Popen([str(spy), "record", "-p", str(pid), "-d", str(int(duration_s)), "-r", "200",
                                          "-f", "raw", "-o", str(out), "--nonblocking"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return samplers


def hottest(path: Path, top: int = 12) -> list[tuple[float, str]]:
    """(share of samples, frame) of the frames most often at the top of the stack, from py-spy's raw output."""
    leaves: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        leaf = stack.split(";")[-1]
        leaves[re.sub(r" \(.*/(site-packages|src)/", " (", leaf)] += int(count)
        total += int(count)
    return [(count / total, frame) for frame, count in leaves.most_common(top)] if total else []


def mlserver_settings(root: Path, onnx_path: Path, workers: int, batching: bool) -> int:
    """MLServer's settings.json and model-settings.json in ``root``; returns its gRPC port."""
    import json
    grpc_port = free_port()
    root.mkdir(parents=True)
    (root / "settings.json").write_text(json.dumps({
        "debug": False, "parallel_workers": workers, "host": "127.0.0.1", "http_port": free_port(),
        "grpc_port": grpc_port, "metrics_port": free_port()}))
    (root / MODEL).mkdir()
    model: dict = {"name": MODEL, "implementation": "_mlserver_onnx_runtime.OnnxRuntime",
                   "parameters": {"uri": str(onnx_path), "extra": {"intra_op_threads": 1}}}
    if batching:
        model.update(max_batch_size=MAX_BATCH, max_batch_time=DELAY_MS / 1000.0)
    (root / MODEL / "model-settings.json").write_text(json.dumps(model))
    return grpc_port


def wait_model_ready(target: str, process: subprocess.Popen, log: Path, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        while time.monotonic() < deadline and process.poll() is None:
            with contextlib.suppress(grpc.RpcError):
                if stub.ModelReady(pb.ModelReadyRequest(name=MODEL), timeout=2).ready:
                    return
            time.sleep(0.5)
    raise RuntimeError(f"{target} never served {MODEL}:\n{log.read_text()[-3000:]}")


async def connect(system: System, rows: np.ndarray, expected: np.ndarray) -> None:
    system.client = triton.InferenceServerClient(system.target)
    tensor = triton.InferInput("features", [1, FEATURES], "FP32")
    tensor.set_data_from_numpy(rows[:1])
    got = (await system.client.infer(MODEL, [tensor], headers=system.headers, client_timeout=30)).as_numpy("scores")
    if not np.allclose(got, expected[:1], atol=1e-4):
        raise AssertionError(f"{system.name} answered {got} for row 0, onnxruntime {expected[:1]}")


def rank_best(candidates: dict[str, list[Level]], index: int) -> str:
    """The setting best at the ``index``-th caller count: the best mean of its ranks by req/s (up) and by
    p99 (down); a tie goes to the higher req/s."""
    names = list(candidates)
    by_rate = sorted(names, key=lambda n: candidates[n][index].rate, reverse=True)
    by_tail = sorted(names, key=lambda n: candidates[n][index].p99_ms)
    return min(names, key=lambda n: (by_rate.index(n) + by_tail.index(n), by_rate.index(n)))


def span(values: list[float], digits: int = 0) -> str:
    low, high = min(values), max(values)
    return f"{low:,.{digits}f}" if round(low, digits) == round(high, digits) else f"{low:,.{digits}f}-{high:,.{digits}f}"


def failures(levels: list[Level]) -> str:
    """Failed calls over the rounds, by status code, and their share of all calls."""
    codes = collections.Counter()
    for level in levels:
        codes.update(level.codes)
    if not codes:
        return "0"
    calls = sum(len(level.latencies_ms) + level.errors for level in levels)
    return ", ".join(f"{count} {code}" for code, count in codes.most_common()) + f" ({sum(codes.values()) / calls:.1%})"


def pooled_p99(levels: list[Level]) -> float:
    pooled = sorted(ms for level in levels for ms in level.latencies_ms)
    return pooled[int(0.99 * (len(pooled) - 1))] if pooled else float("nan")


def report(results: dict[str, dict[int, list[Level]]], peer_settings: dict[int, str], callers: list[int]) -> None:
    peer = PEER
    mine = [name for name in (OURS, DIRECT) if name in results]
    print("\n| callers | system | req/s | p50 ms | p99 ms | p99 pooled | CPU s / 1,000 req | errors |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for count in callers:
        for name in (*mine, peer):
            levels = results[name][count]
            label = peer_settings[count] if name == PEER else name
            print(f"| {count} | {label} | {span([lv.rate for lv in levels])} | {span([lv.p50_ms for lv in levels], 1)} "
                  f"| {span([lv.p99_ms for lv in levels], 1)} | {pooled_p99(levels):.1f} "
                  f"| {span([lv.cpu_per_1000_s for lv in levels], 2)} | {failures(levels)} |")
    pairs = [(name, peer) for name in mine] + ([(DIRECT, OURS)] if len(mine) == 2 else [])
    print("\n| callers | arms | req/s ÷ (per round) | p99 pooled, difference ms | per CPU-s ÷ |")
    print("|---:|---|---:|---:|---:|")
    for count in callers:
        for first, second in pairs:
            ones, others = results[first][count], results[second][count]
            rate = [m.rate / t.rate for m, t in zip(ones, others)]
            cpu = [t.cpu_per_1000_s / m.cpu_per_1000_s for m, t in zip(ones, others)]
            print(f"| {count} | {first} ÷ {second} | {span(rate, 2)}x ({', '.join(f'{r:.2f}' for r in rate)}) "
                  f"| {pooled_p99(ones) - pooled_p99(others):+.1f} | {span(cpu, 2)}x |")
    for name in mine:
        where(results[name], callers, name)
    published = sum(lv.stages["published"] for name in mine for lvs in results[name].values() for lv in lvs)
    dropped = sum(lv.stages["dropped"] for name in mine for lvs in results[name].values() for lv in lvs)
    print(f"\nprediction log: {published:.0f} predictions published, {dropped:.0f} dropped while measured")


def where(results: dict[int, list[Level]], callers: list[int], name: str) -> None:
    """Where one of our arms spends its time and CPU (means over the rounds)."""
    print(f"\nWhere {name} spends it (means over the rounds): client-seen mean latency, of which the router's "
          "(admission to answer, worker round trip included; the direct path's as the front reports it) and the "
          "worker batcher's (queue wait + batch run); CPU ms per request by process.")
    print("\n| callers | client mean ms | router ms | worker ms | > 25 ms per 1k: client / router / worker "
          "| rows/batch | backups/1k | CPU ms/req by process |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for count in callers:
        levels = results[count]
        client = statistics.mean(statistics.mean(lv.latencies_ms) for lv in levels if lv.latencies_ms)
        stage = {key: statistics.mean(lv.stages[key] for lv in levels) for key in levels[0].stages}
        requests = sum(len(lv.latencies_ms) for lv in levels)
        labels = sorted({label for lv in levels for label in lv.by_process})
        cpu = ", ".join(f"{label} {statistics.mean(lv.by_process.get(label, 0.0) for lv in levels):.3f}"
                        for label in labels)
        slow = sum(ms > 25.0 for lv in levels for ms in lv.latencies_ms) / max(requests, 1) * 1000
        cpu += f", broker + S3 + Redis {statistics.mean(lv.infra_per_1000_s for lv in levels):.3f}"
        print(f"| {count} | {client:.2f} | {stage['router_ms']:.2f} | {stage['worker_ms']:.2f} | "
              f"{slow:.1f} / {stage['router_slow']:.1f} / {stage['worker_slow']:.1f} | "
              f"{stage['batch_rows']:.1f} | {sum(lv.stages['backups'] for lv in levels) / requests * 1000:.1f} "
              f"| {cpu} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--callers", default="1,8,32", help="closed-loop callers, comma separated")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every caller count, arms alternated")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds measured per level")
    parser.add_argument("--warmup", type=float, default=1.5, help="seconds of load before each level")
    parser.add_argument("--mlserver-settings", default="0:on,0:off,1:on,2:on",
                        help="MLServer parallel_workers:adaptive batching (on/off) settings to choose from")
    parser.add_argument("--select-duration", type=float, default=3.0, help="seconds per level choosing MLServer's")
    parser.add_argument("--profile", type=Path, help="py-spy the router's processes into this directory")
    parser.add_argument("--profile-callers", type=int, default=8)
    parser.add_argument("--router-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting of the router's (repeatable), e.g. OPML_INFERENCE_ROUTER_PREDICTION_LINGER_MS=0")
    parser.add_argument("--direct", choices=("off", "on", "both"), default="both",
                        help="the router's direct data plane (OPML_INFERENCE_ROUTER_DIRECT_DATA_PLANE): off, on, or "
                        "both (a second router with it on, a third arm in the rotation)")
    parser.add_argument("--busy-loops", type=int, default=0, metavar="N",
                        help="processes that only spin beside the whole bench (default none)")
    args = parser.parse_args()
    callers = [int(count) for count in args.callers.split(",")]
    python = peer_python("mlserver")
    mlserver_bin = python.parent / "mlserver"
    with tempfile.TemporaryDirectory(prefix="opml-bench-tail-") as tmp, bench_services() as (starter, _work), \
            ExitStack() as servers:
        work = Path(tmp)
        for _ in range(args.busy_loops):
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            servers.callback(stop, spinner)
        bundle = write_model_dir(work / MODEL, mlp_config(
            MODEL, features=FEATURES, classes=CLASSES, max_batch_size=MAX_BATCH,
            max_queue_delay_us=int(DELAY_MS * 1000), pool_kinds=("cpu",), precisions=("fp32",), p99_ms=SLO_P99_MS),
            mlp_classifier(features=FEATURES, width=WIDTH, depth=DEPTH, classes=CLASSES))
        onnx_path = bundle / "model.onnx"
        rows = np.random.default_rng(0).standard_normal((ROWS, FEATURES)).astype(np.float32)
        expected = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(
            None, {"features": rows})[0]

        routers, arms = [], []
        for name, direct in ((OURS, False), (DIRECT, True)):
            if args.direct != "both" and direct != (args.direct == "on"):
                continue
            env = starter.env("inference-router", tokens={**TOKENS, "inference": INFERENCE_TOKEN}, extra_env={
                **dict(setting.split("=", 1) for setting in args.router_env),
                "OPML_INFERENCE_ROUTER_DIRECT_DATA_PLANE": str(direct).lower()})
            router = starter("inference-router", env=env)
            routers.append(router)
            with DeploymentClient(router.target, token=TOKENS["writer"]) as deployments:
                deployment = deployments.deploy(model_dir=str(bundle))
            metrics = f"http://127.0.0.1:{env['OPML_INFERENCE_ROUTER_METRICS_PORT']}/metrics"
            arms.append(System(name, f"127.0.0.1:{env['OPML_INFERENCE_ROUTER_INFERENCE_PORT']}",
                               router.process.pid, {"authorization": f"Bearer {INFERENCE_TOKEN}"}, Scrape(metrics)))
        workers = [p for p in psutil.Process(router.process.pid).children(recursive=True) if _label(p) == "worker"]
        print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores shared with this load "
              f"generator; MLP {FEATURES}-{WIDTH}-{WIDTH}-{CLASSES} fp32, one row a request, batching max {MAX_BATCH} / "
              f"{DELAY_MS:g} ms, SLO p99 {SLO_P99_MS:g} ms; router as `make up` runs it: {len(workers)} workers, "
              f"deployed as `opml model deploy` does ({deployment.name}), prediction log on, auth on; {args.rounds} round(s) of {args.duration:g} s per level after "
              f"{args.warmup:g} s; client deadline {DEADLINE_S:g} s; router settings: {args.router_env or 'defaults'}; "
              f"arms: {', '.join(arm.name for arm in arms)}; busy loops beside: {args.busy_loops}; load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}",
              flush=True)

        async def choose_mlserver() -> dict[int, System]:
            """Each setting at each caller count; the best one at each count is started again for the rounds."""
            measured: dict[str, list[Level]] = {}
            settings: dict[str, tuple[int, bool]] = {}
            print("\nchoosing MLServer's setting:\n\n| setting | callers | req/s | p50 ms | p99 ms | CPU s / 1,000 |\n"
                  "|---|---:|---:|---:|---:|---:|", flush=True)
            for setting in args.mlserver_settings.split(","):
                workers_text, batching = setting.split(":")
                root, log = work / f"mlserver-{len(measured)}", work / f"mlserver-{len(measured)}.log"
                port = mlserver_settings(root, onnx_path, int(workers_text), batching == "on")
                process, _ = start([str(mlserver_bin), "start", str(root)], log, env={"PYTHONPATH": str(BENCH)},
                                   announce=False)
                try:
                    wait_model_ready(f"127.0.0.1:{port}", process, log)
                    name = (f"MLServer ({int(workers_text)} parallel workers" if int(workers_text) else
                            "MLServer (in-process") + f", adaptive batching {batching})"
                    system = System(name, f"127.0.0.1:{port}", process.pid)
                    await connect(system, rows, expected)
                    measured[name], settings[name] = [], (int(workers_text), batching == "on")
                    for count in callers:
                        level = await measure(system, rows, count, args.warmup, args.select_duration)
                        measured[name].append(level)
                        print(f"| {name} | {count} | {level.rate:.0f} | {level.p50_ms:.1f} | {level.p99_ms:.1f} | "
                              f"{level.cpu_per_1000_s:.2f} |", flush=True)
                    await system.client.close()
                finally:
                    stop(process)  # also when a setting fails: no server outlives the bench
            best = {count: rank_best(measured, index) for index, count in enumerate(callers)}
            started: dict[str, System] = {}
            for count, name in best.items():
                print(f"best at {count} callers: {name}", flush=True)
                if name not in started:
                    root, log = work / f"mlserver-best-{len(started)}", work / f"mlserver-best-{len(started)}.log"
                    port = mlserver_settings(root, onnx_path, *settings[name])
                    process, _ = start([str(mlserver_bin), "start", str(root)], log, env={"PYTHONPATH": str(BENCH)},
                                       announce=False)
                    servers.callback(stop, process)
                    wait_model_ready(f"127.0.0.1:{port}", process, log)
                    started[name] = System(name, f"127.0.0.1:{port}", process.pid)
                    await connect(started[name], rows, expected)
            return {count: started[name] for count, name in best.items()}

        async def rounds() -> dict[str, dict[int, list[Level]]]:
            peers = await choose_mlserver()
            for arm in arms:
                await connect(arm, rows, expected)
            results: dict[str, dict[int, list[Level]]] = {name: {c: [] for c in callers}
                                                          for name in (*(arm.name for arm in arms), PEER)}
            print("\n| round | callers | system | req/s | p50 ms | p99 ms | CPU s / 1,000 | errors |\n"
                  "|---:|---:|---|---:|---:|---:|---:|---:|", flush=True)
            turn = 0
            for round_number in range(args.rounds):
                for count in callers:
                    systems = [*arms, peers[count]]
                    order = systems[turn % len(systems):] + systems[:turn % len(systems)]  # each goes first in turn
                    turn += 1
                    for system in order:
                        profile = (args.profile if args.profile and system in arms and count == args.profile_callers
                                   and round_number == args.rounds - 1 else None)
                        level = await measure(system, rows, count, args.warmup, args.duration, profile)
                        results[PEER if system is peers[count] else system.name][count].append(level)
                        print(f"| {round_number + 1} | {count} | {system.name} | {level.rate:.0f} | "
                              f"{level.p50_ms:.1f} | {level.p99_ms:.1f} | {level.cpu_per_1000_s:.2f} | "
                              f"{failures([level])} |", flush=True)
            for system in {*arms, *peers.values()}:
                await system.client.close()
            report(results, {count: peer.name for count, peer in peers.items()}, callers)
            return results

        asyncio.run(rounds())
        if args.profile:
            for path in sorted(args.profile.glob("*.txt")):
                print(f"\npy-spy {path.name}: hottest frames (share of samples, idle excluded)")
                for share, frame in hottest(path):
                    print(f"  {share * 100:5.1f}%  {frame}")
        for router in routers:
            router.stop()


if __name__ == "__main__":
    main()
