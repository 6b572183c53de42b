"""Progressive rollouts' automated analysis, through the real router as a user drives it: how often it
rolls back a version that is no worse (A/A), how fast it takes a worse one back, and whether the
rollout itself fails requests.

Real services (embedded tansu, SeaweedFS, Redis; the inference-router as a process, two cpu workers
of four replica slots each; the prediction log on). Open-loop Poisson traffic of one-row requests at
``--rate`` goes to the router's inference port (tritonclient's gRPC aio client: the KServe v2
protocol, auth on); each answer says which version served it. The rollout's decisions are read back
from opml.deployments.v1.

The models are linear 16-feature, 4-class classifiers (ONNX graphs built here from known weights),
with a p99 SLO of ``--slo-ms`` (placement and admission price against it).

1. **Baseline**: the stable version alone for ``--baseline-s`` before the rollouts and as long after
   them: the failures without any rollout, at the machine's load then.
2. **A/A**: the same bundle deployed again as the new version under a rollout of one ``weight: 50``
   step and one analysis of ``--measurements`` measurements of ``--interval-s`` (failure_limit and
   inconclusive_limit as high, so the analysis goes on and every measurement is one decision the
   router makes and reports). Checks: error_rate (``--max-increase``) and p99_latency
   (``--max-ratio``), ``--min-requests`` each. The **false-rollback rate** is the share of FAILED
   measurements (with ``failure_limit: 0``, each would have rolled the version back); the
   **false-pause rate** the share of INCONCLUSIVE ones. From the router's own p99s of both versions
   the rate at other ``max_ratio`` bounds and per rollout of ``--count`` measurements; from the
   client's latencies, the same p99 check over measurements 2, 4 and 8 times longer (more requests a
   version: what ``min_requests`` and ``interval_s`` would have to be).
3. **A worse model** (version 2 of another model): the stable model's weights of feature 0 bent so
   that on a drifted slice (feature 0 shifted by +3) it is about 10 points less accurate; traffic is
   that slice, each answer scored against its label. The real monitoring-scorer (a bundle-store
   holds each version's reference: 2,000 undrifted rows with the version's own scores and their
   labels, and monitoring.yaml with the scorer's default window of 1000 predictions) scores the
   predictions the router publishes; the label of ``--label-share`` of the requests is submitted to it
   (SubmitLabels) as soon as the answer comes. The rollout (``--quality-count`` measurements,
   failure_limit 0, inconclusive_limit 1) checks the router's two and ``accuracy`` (``--max-drop``,
   ``--min-labels``: the labels the scorer joined in its windows of each version since the analysis
   began). Timed: from the scorer's window event (WindowScored on opml.quality.v1, read here too) that
   first gave both versions ``--min-labels`` labels, the first moment the check could count the bad
   answers, to traffic back on the stable version (the last request the new version answered), in
   analysis intervals; and from the first request the new version answered in the analysis (the
   scorer's window cadence included).
4. **A slower model**: the stable model with ``--slow-ms`` of compute more a request (default: the
   baseline's median p99 over an interval, at most 5 ms, so its p99 is about 2x; calibrated here in
   onnxruntime, one thread; the run prints the ratio it got), ``--repeats`` rollouts of the same spec.
   The time from the first request the analysis could count (the first sent to the new version after
   its analysis step started) to traffic back on the stable version (the last request sent that the
   new version answered), in seconds and in intervals; the router's own (analysis step started ->
   RolloutAborted) beside it.
5. **The rollout's own errors**: requests that failed during the rollouts (A/A, worse, slower: while
   the new version is deployed, takes traffic, is promoted or retired) beyond the baseline's rate.

    .venv/bin/python bench/inference_router_rollout.py                # ~10 min
    .venv/bin/python bench/inference_router_rollout.py --measurements 30 --repeats 2 --baseline-s 10   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import re
import shutil
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import onnx
import onnxruntime as ort
import tritonclient.grpc.aio as triton
import yaml
from _stack import bench_services
from aiokafka import AIOKafkaConsumer
from onnx import TensorProto, helper, numpy_helper
from opml.inference.v1 import deployment_events_pb2 as events
from opml.monitoring.v1 import monitoring_pb2, monitoring_pb2_grpc, quality_events_pb2
from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.bus import CloudEvent
from opml_common.errors import FailedPrecondition
from opml_devstack.testing.services import TOKENS
from opml_inference_router.control.analysis import measure
from opml_inference_router.control.quality import Quality
from opml_inference_router.routing.window import Measures
from opml_inference_router.testing import fleet_env, mlp_config, write_model_dir
from opml_inference_router_contract.client import DeploymentClient
from opml_inference_router_contract.rollout_spec import (
    ACCURACY,
    ERROR_RATE,
    P99_LATENCY,
    ROLLOUT_FILE,
    Analysis,
    Check,
)
from opml_inference_router_contract.topics import DEPLOYMENTS
from opml_monitoring_scorer_contract.client import MonitoringClient
from opml_monitoring_scorer_contract.names import version_name
from opml_monitoring_scorer_contract.reference import reference_npz
from opml_monitoring_scorer_contract.topics import QUALITY

FEATURES, CLASSES = 16, 4
FLEET = {
    "pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 4096, "slots": 4, "cost_per_hour": 0.4,
                    "execution_provider": "CPUExecutionProvider"}],
    "pools": [{"name": "cpu", "kind": "cpu", "workers": 2}],
    "min_replicas": 1,
}
"""Two workers of four replica slots each: room for a model's stable and new versions whatever replicas each needs."""
BALLAST_DEPTH, BALLAST_WIDTH = 8, 256
DRIFT = 3.0  # the drifted slice: feature 0 shifted by this many standard deviations
AUTH = {"authorization": f"Bearer {TOKENS['writer']}"}
ROUTER_CHECKS = (ERROR_RATE, P99_LATENCY)
"""The checks every analysis here runs: the router's own measures of both versions."""
ENDS = (events.RolloutPromoted, events.RolloutAborted, events.RolloutPaused)
MONITORING = f"""
task: multiclass
features: {{features: [{", ".join(f"f{i}" for i in range(FEATURES))}]}}
outputs: {{scores: scores}}
"""
"""The worse model's monitoring.yaml: the scorer's default window (1000 predictions)."""
REFERENCE_ROWS = 2000


# -- models ------------------------------------------------------------------------------------------


def classifier(weights: np.ndarray, bias: np.ndarray, *, ballast: int = 0) -> onnx.ModelProto:
    """``scores = softmax(x W + b + 0 * sum(ballast(x)))`` on ``x: float32[batch, 16]``: a linear
    classifier, plus 8 ReLU layers 256 wide over the input tiled to ``ballast`` rows (weights that stay
    in cache: the cost grows with the rows) whose sum is multiplied by 0, so it costs time and changes
    no answer."""
    rng = np.random.default_rng(7)
    inits = [numpy_helper.from_array(weights.astype(np.float32), "w"),
             numpy_helper.from_array(bias.astype(np.float32), "b")]
    nodes = [helper.make_node("MatMul", ["features", "w"], ["xw"])]
    if ballast:
        inits += [numpy_helper.from_array(np.array([ballast, 1], np.int64), "tiles"),
                  numpy_helper.from_array(np.zeros(1, np.float32), "zero")]
        nodes.append(helper.make_node("Tile", ["features", "tiles"], ["h_in"]))
        previous, fan_in = "h_in", FEATURES
        for layer in range(BALLAST_DEPTH):
            inits.append(numpy_helper.from_array(
                (rng.standard_normal((fan_in, BALLAST_WIDTH)) / np.sqrt(fan_in)).astype(np.float32), f"h{layer}w"))
            nodes += [helper.make_node("MatMul", [previous, f"h{layer}w"], [f"h{layer}m"]),
                      helper.make_node("Relu", [f"h{layer}m"], [f"h{layer}"])]
            previous, fan_in = f"h{layer}", BALLAST_WIDTH
        nodes += [helper.make_node("ReduceSum", [previous], ["h_sum"], keepdims=0),
                  helper.make_node("Mul", ["h_sum", "zero"], ["h_zero"]),
                  helper.make_node("Add", ["xw", "h_zero"], ["xw0"])]
    nodes += [helper.make_node("Add", ["xw0" if ballast else "xw", "b"], ["logits"]),
              helper.make_node("Softmax", ["logits"], ["scores"], axis=-1)]
    graph = helper.make_graph(
        nodes, "linear_classifier",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", FEATURES])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", CLASSES])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="opml-bench")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def run_ms(model: onnx.ModelProto, rows: np.ndarray) -> float:
    """Median ms of one row on one onnxruntime thread, in this process."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    times = []
    for i in range(200):
        start = time.perf_counter()
        session.run(None, {"features": rows[i:i + 1]})
        times.append(time.perf_counter() - start)
    return statistics.median(times[50:]) * 1000


def ballast_for(ms: float, task: Task, rows: np.ndarray) -> tuple[int, float]:
    """The ballast rows that add about ``ms`` to a request here, and what they add (measured)."""
    base = run_ms(classifier(task.weights, task.bias), rows)
    tiles, added = 64, run_ms(classifier(task.weights, task.bias, ballast=64), rows) - base
    for _ in range(3):  # the cost per row grows once activations leave the cache: rescale a few times
        tiles = max(1, round(tiles * ms / added))
        added = run_ms(classifier(task.weights, task.bias, ballast=tiles), rows) - base
    return tiles, added


@dataclass
class Task:
    """The ground truth: ``y = argmax(x W + b + noise)``; the stable model knows W and b."""

    weights: np.ndarray
    bias: np.ndarray

    @classmethod
    def make(cls, seed: int = 0) -> Task:
        rng = np.random.default_rng(seed)
        return cls(rng.standard_normal((FEATURES, CLASSES)), 0.1 * rng.standard_normal(CLASSES))

    def sample(self, n: int, *, drifted: bool, seed: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((n, FEATURES)).astype(np.float32)
        if drifted:
            x[:, 0] += DRIFT
        logits = x @ self.weights + self.bias + 1.0 * rng.standard_normal((n, CLASSES))
        return x, logits.argmax(axis=1)


def accuracy(weights: np.ndarray, bias: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    return float(((x @ weights + bias).argmax(axis=1) == y).mean())


def reference(weights: np.ndarray, bias: np.ndarray, x: np.ndarray, y: np.ndarray) -> bytes:
    """reference.npz of held-out (undrifted) rows: the version's own scores on them, and their labels."""
    logits = x @ weights + bias
    scores = np.exp(logits - logits.max(axis=1, keepdims=True))
    scores /= scores.sum(axis=1, keepdims=True)
    return reference_npz({f"f{i}": x[:, i] for i in range(FEATURES)}, predicted=scores.argmax(axis=1),
                         scores=scores.astype(np.float32), labels=y)


def worse_weights(task: Task, points: float, drifted: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """The task's weights with feature 0's row bent (bisected) until accuracy on the ``drifted`` rows is
    ``points`` lower."""
    x, y = drifted
    target = accuracy(task.weights, task.bias, x, y) - points
    direction = np.roll(task.weights[0], 1) - task.weights[0]
    low, high = 0.0, 4.0
    for _ in range(40):
        bent = task.weights.copy()
        bent[0] += (low + high) / 2 * direction
        if accuracy(bent, task.bias, x, y) > target:
            low = (low + high) / 2
        else:
            high = (low + high) / 2
    return bent


def bundle(directory: Path, name: str, model: onnx.ModelProto, args: argparse.Namespace,
           spec: dict | None = None) -> Path:
    config = mlp_config(name, features=FEATURES, classes=CLASSES, pool_kinds=("cpu",), precisions=("fp32",),
                        max_queue_delay_us=None, p99_ms=args.slo_ms)
    config["expected_rate_rps"] = args.rate
    if directory.exists():
        shutil.rmtree(directory)
    write_model_dir(directory, config, model)
    if spec is not None:
        (directory / ROLLOUT_FILE).write_text(yaml.safe_dump(spec))
    return directory


def rollout_spec(args: argparse.Namespace, count: int, *, limits: int, quality: bool = False) -> dict:
    checks = {ERROR_RATE: {"max_increase": args.max_increase, "min_requests": args.min_requests},
              P99_LATENCY: {"max_ratio": args.max_ratio, "min_requests": args.min_requests}}
    if quality:
        checks[ACCURACY] = {"max_drop": args.max_drop, "min_labels": args.min_labels}
    return {"steps": [{"weight": 50}, {"analysis": {
        "interval_s": args.interval_s, "count": count, "failure_limit": limits,
        "inconclusive_limit": max(limits, 1), "checks": checks}}]}


# -- traffic -------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    sent: float            # wall clock (the router's events use it too)
    latency_s: float
    version: str           # "" when failed
    code: str              # "OK" or the status code
    correct: bool | None   # None when the request has no label or failed
    labelled: bool = False  # its label was submitted to the scorer


@dataclass
class Traffic:
    """Open-loop Poisson requests of one row each to ``model``, until :meth:`stop`."""

    client: triton.InferenceServerClient
    model: str
    rate: float
    rows: np.ndarray
    labels: np.ndarray | None = None
    monitor: MonitoringClient | None = None  # where a share of the answers' labels go
    label_share: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    labelled: int = 0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task | None = None
    _labeller: asyncio.Task | None = None
    _pending: list[tuple[str, list[float], None]] = field(default_factory=list)
    _rng: random.Random = field(default_factory=lambda: random.Random(5))

    def start(self) -> Traffic:
        self._task = asyncio.create_task(self._run())
        if self.monitor is not None:
            self._labeller = asyncio.create_task(self._label())
        return self

    async def stop(self) -> list[Outcome]:
        self._stop.set()
        if self._task is not None:
            await self._task
        if self._labeller is not None:
            await self._labeller
        return self.outcomes

    async def _label(self) -> None:
        """Submits the labels of the answers so far every 0.2 s (and the last ones at the end)."""
        while True:
            stopping = self._stop.is_set() and self._task is not None and self._task.done()
            batch, self._pending = self._pending, []
            for start in range(0, len(batch), 1000):
                self.labelled += await asyncio.to_thread(self.monitor.submit_labels, self.model,  # type: ignore[union-attr]
                                                         batch[start:start + 1000])
            if stopping:
                return
            await asyncio.sleep(0.2)

    async def _run(self) -> None:
        rng, pending, index = random.Random(3), set(), 0
        next_at = time.perf_counter()
        while not self._stop.is_set():
            next_at += rng.expovariate(self.rate)
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self._one(index % len(self.rows), f"{self.model}-{id(self):x}-{index}"))
            pending.add(task)
            task.add_done_callback(pending.discard)
            index += 1
        await asyncio.gather(*pending)

    async def _one(self, index: int, request_id: str) -> None:
        tensor = InferInput("features", [1, FEATURES], "FP32")
        tensor.set_data_from_numpy(self.rows[index:index + 1])
        sent, start = time.time(), time.perf_counter()
        try:
            result = await self.client.infer(self.model, [tensor], headers=AUTH, client_timeout=10,
                                             request_id=request_id)
        except InferenceServerException as error:
            self.outcomes.append(Outcome(sent, time.perf_counter() - start, "", str(error.status()), None))
            return
        latency = time.perf_counter() - start
        correct = None
        if self.labels is not None:
            correct = bool(result.as_numpy("scores")[0].argmax() == self.labels[index])
            if self.monitor is not None and self._rng.random() < self.label_share:
                self._pending.append((request_id, [float(self.labels[index])], None))
                self.outcomes.append(Outcome(sent, latency, result.get_response().model_version, "OK", correct, True))
                return
        self.outcomes.append(Outcome(sent, latency, result.get_response().model_version, "OK", correct))


def p99_ms(outcomes: list[Outcome], version: str | None = None) -> float:
    latencies = sorted(o.latency_s for o in outcomes if o.code == "OK" and version in (None, o.version))
    return latencies[min(len(latencies) - 1, math.ceil(0.99 * len(latencies)) - 1)] * 1000 if latencies else math.nan


def window_p99_ms(outcomes: list[Outcome], interval_s: float) -> float:
    """The median over ``interval_s`` windows of each window's p99 (what one measurement compares)."""
    first = min(o.sent for o in outcomes)
    windows: dict[int, list[Outcome]] = {}
    for o in outcomes:
        windows.setdefault(int((o.sent - first) // interval_s), []).append(o)
    return statistics.median(p99_ms(w) for w in windows.values())


def failures(outcomes: list[Outcome]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in outcomes:
        if o.code != "OK":
            counts[o.code] = counts.get(o.code, 0) + 1
    return counts


# -- the router's decisions, from the bus -----------------------------------------------------------------


class DeploymentEvents:
    """Every event of opml.deployments.v1 since the start, read as it comes."""

    def __init__(self, bootstrap: str, *topics: str) -> None:
        self._consumer = AIOKafkaConsumer(*topics, bootstrap_servers=bootstrap, group_id=None,
                                          metadata_max_age_ms=1000,  # a topic made after the start (quality)
                                          auto_offset_reset="earliest", enable_auto_commit=False)
        self.events: list[CloudEvent] = []
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> DeploymentEvents:
        await self._consumer.start()
        self._task = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._consumer.stop()

    async def _read(self) -> None:
        while True:
            batch = await self._consumer.getmany(timeout_ms=200)
            for part in batch.values():
                self.events.extend(CloudEvent.from_kafka(r.headers, r.value) for r in part)

    def of(self, kind: type, model: str, version: int | None = None) -> list[tuple[float, object]]:
        """(event time, message) of each ``kind`` event about ``model`` (and ``version``)."""
        found = []
        for event in list(self.events):
            if event.subject == model and event.type == kind.DESCRIPTOR.full_name:
                message = event.parse(kind)
                if version is None or getattr(message, "version", version) == version:
                    found.append((event.time.timestamp(), message))
        return found

    def windows(self, model: str, version: int) -> list[tuple[float, object]]:
        """(event time, WindowScored) of the monitoring-scorer's windows of ``model`` ``version``."""
        found = []
        for event in list(self.events):
            if event.type == quality_events_pb2.WindowScored.DESCRIPTOR.full_name:
                message = event.parse(quality_events_pb2.WindowScored)
                if message.model == model and message.version == str(version) and not message.segment:
                    found.append((event.time.timestamp(), message))
        return found

    async def end_of(self, model: str, version: int, timeout_s: float) -> tuple[float, object]:
        """The event that ended ``version``'s rollout (promoted, aborted or paused)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ends = sorted((e for kind in ENDS for e in self.of(kind, model, version)), key=lambda e: e[0])
            if ends:
                return ends[0]
            await asyncio.sleep(0.05)
        raise TimeoutError(f"the rollout of models/{model} version {version} did not end in {timeout_s:.0f} s")


class ScorerPoll:
    """The scorer's own windows of the worse model's versions (``ListWindows`` with the open window's
    labels so far, as the router reads them while its events lack a check's minimum), read every
    ``every_s``: when the scorer's evidence could first fail the accuracy check, which its window
    events say only once 1,000 predictions close a window."""

    def __init__(self, target: str, model: str, versions: tuple[int, ...], every_s: float = 0.5) -> None:
        self._target, self._model, self._versions, self._every_s = target, model, versions, every_s
        self.reads: list[tuple[float, dict[int, list[object]]]] = []
        self._task: asyncio.Task | None = None

    def start(self) -> ScorerPoll:
        self._task = asyncio.create_task(self._poll())
        return self

    async def stop(self) -> list[tuple[float, dict[int, list[object]]]]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        return self.reads

    async def _poll(self) -> None:
        # on this loop's gRPC (asyncio): a synchronous client's calls from a thread beside the aio
        # traffic client crashed the process in cygrpc (SIGSEGV) twice here
        async with grpc.aio.insecure_channel(self._target) as channel:
            stub = monitoring_pb2_grpc.MonitoringServiceStub(channel)
            while True:
                read = {}
                for version in self._versions:
                    reply = await stub.ListWindows(monitoring_pb2.ListWindowsRequest(
                        name=version_name(self._model, str(version)), page_size=1000, include_open=True),
                        metadata=tuple(AUTH.items()), timeout=10)
                    read[version] = list(reply.windows)
                self.reads.append((time.time(), read))
                await asyncio.sleep(self._every_s)


# -- a rollout driven by traffic ----------------------------------------------------------------------------


@dataclass
class RolloutRun:
    model: str
    version: int
    outcomes: list[Outcome]
    deploy_called: float
    end: tuple[float, object]
    analysis_started: float
    measurements: list[object]
    labelled: int = 0

    @property
    def ended(self) -> str:
        return type(self.end[1]).__name__.removeprefix("Rollout").upper()


async def roll_out(deployments: DeploymentClient, log: DeploymentEvents, traffic: Traffic, model_dir: Path,
                   timeout_s: float) -> RolloutRun:
    """Starts ``traffic``, deploys ``model_dir`` (it carries rollout.yaml), and stops the traffic once the
    rollout ended and a second more was answered (the promotion or rollback under load).

    Raises: FailedPrecondition (placement refused the version), TimeoutError."""
    traffic.start()
    try:
        called = time.time()
        deployed = await asyncio.to_thread(deployments.deploy, model_dir=str(model_dir))
        version = max(v.version for v in deployed.versions)
        end = await log.end_of(traffic.model, version, timeout_s)
        await asyncio.sleep(1.0)
    finally:
        await traffic.stop()
    analysis = [t for t, m in log.of(events.RolloutStepStarted, traffic.model, version) if m.spec.kind == "analysis"]
    measured = [m for _, m in log.of(events.RolloutAnalysisCompleted, traffic.model, version)]
    return RolloutRun(traffic.model, version, traffic.outcomes, called, end, analysis[0] if analysis else math.nan,
                      measured, traffic.labelled)


def check(run_measurements: list[object], name: str) -> list[object]:
    return [c for m in run_measurements for c in m.checks if c.check == name]


def metric(port: str, name: str, **labels: str) -> float:
    """The sum of a metric's series on the router's /metrics whose labels include ``labels``."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    total = 0.0
    for found, value in re.findall(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        if all(f'{key}="{wanted}"' in found for key, wanted in labels.items()):
            total += float(value)
    return total


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


# -- the bench ------------------------------------------------------------------------------------------------


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=150.0, help="requests/s, open loop (Poisson)")
    parser.add_argument("--interval-s", type=float, default=3.0)
    parser.add_argument("--measurements", type=int, default=100, help="A/A analysis decisions")
    parser.add_argument("--count", type=int, default=4, help="measurements of the worse/slower models' analysis")
    parser.add_argument("--max-ratio", type=float, default=1.5)
    parser.add_argument("--max-increase", type=float, default=0.01)
    parser.add_argument("--min-requests", type=int, default=100)
    parser.add_argument("--baseline-s", type=float, default=30.0)
    parser.add_argument("--repeats", type=int, default=5, help="rollouts of the slower model")
    parser.add_argument("--slow-ms", type=float, default=0.0,
                        help="compute the slower version adds to a request (calibrated here, one thread; 0: the "
                             "baseline's median p99 over an interval, at most 5 ms)")
    parser.add_argument("--accuracy-drop", type=float, default=0.10)
    parser.add_argument("--quality-count", type=int, default=30,
                        help="measurements of the worse model's analysis (it checks accuracy too)")
    parser.add_argument("--max-drop", type=float, default=0.05, help="the accuracy check's bound")
    parser.add_argument("--min-labels", type=int, default=100, help="labels of each version the check needs")
    parser.add_argument("--label-share", type=float, default=0.5, help="share of the worse model's requests labelled")
    parser.add_argument("--slo-ms", type=float, default=250.0, help="the models' p99 SLO (placement, admission)")
    args = parser.parse_args()

    task = Task.make()
    drift_x, drift_y = task.sample(50_000, drifted=True, seed=21)
    plain_x, plain_y = task.sample(50_000, drifted=False, seed=22)
    bent = worse_weights(task, args.accuracy_drop, (drift_x, drift_y))
    stable_model, worse_model = classifier(task.weights, task.bias), classifier(bent, task.bias)
    print(f"cores {os.cpu_count()}, load {os.getloadavg()}; {args.rate:g} requests/s open loop, analysis every "
          f"{args.interval_s:g} s, checks error_rate max_increase {args.max_increase:g} and p99_latency max_ratio "
          f"{args.max_ratio:g}, min_requests {args.min_requests}")
    print(f"worse model: accuracy on the drifted slice {accuracy(bent, task.bias, drift_x, drift_y):.3f} against "
          f"{accuracy(task.weights, task.bias, drift_x, drift_y):.3f}, undrifted "
          f"{accuracy(bent, task.bias, plain_x, plain_y):.3f} against "
          f"{accuracy(task.weights, task.bias, plain_x, plain_y):.3f}"
          f" (offline, the 50,000 rows sent)")

    started = time.monotonic()
    with bench_services() as (starter, workdir):
        store = starter("bundle-store")
        scorer = starter("monitoring-scorer", extra_env={
            "OPML_MONITORING_SCORER_BUNDLE_STORE_TARGET": store.target,
            "OPML_MONITORING_SCORER_BUNDLE_STORE_TOKEN": TOKENS["reader"],
            "OPML_MONITORING_SCORER_AUTOREGISTER": "false"})  # only the worse model's versions, registered below
        env = starter.env("inference-router", extra_env={
            **fleet_env(workdir / "fleet.yaml", FLEET), "OPML_INFERENCE_ROUTER_MONITORING_SCORER_TARGET": scorer.target,
            "OPML_INFERENCE_ROUTER_MONITORING_SCORER_TOKEN": TOKENS["reader"]})
        router = starter("inference-router", env=env)
        target = f"127.0.0.1:{env['OPML_INFERENCE_ROUTER_INFERENCE_PORT']}"
        metrics_port = env["OPML_INFERENCE_ROUTER_METRICS_PORT"]
        topics = (DEPLOYMENTS.full_name(env["OPML_TOPIC_PREFIX"]), QUALITY.full_name(env["OPML_TOPIC_PREFIX"]))
        with BundleStoreClient(store.target, token=TOKENS["writer"]) as bundles, \
                MonitoringClient(scorer.target, token=TOKENS["admin"]) as monitor:
            bundles.create_context("bench")  # each version's reference, registered now: the scorer fits its MPP
            for version, weights in ((1, task.weights), (2, bent)):
                made = bundles.add("bench", f"acc-v{version}-reference", {
                    "reference.npz": reference(weights, task.bias, plain_x[:REFERENCE_ROWS], plain_y[:REFERENCE_ROWS]),
                    "monitoring.yaml": MONITORING.encode()}, commit=True)
                monitor.register("acc", str(version), "bench", made.uuid)
        async with DeploymentEvents(env["OPML_KAFKA_BOOTSTRAP"], *topics) as log, \
                triton.InferenceServerClient(target) as client:
            with DeploymentClient(router.target, token=TOKENS["writer"]) as deployments, \
                    DeploymentClient(router.target, token=TOKENS["admin"]) as admin, \
                    MonitoringClient(scorer.target, token=TOKENS["writer"]) as labeller:
                timeout = args.interval_s * (args.measurements * 2 + 20) + 120

                # 1. baseline and 2. A/A: the same bundle twice
                deployments.deploy(model_dir=str(bundle(workdir / "aa-1", "aa", stable_model, args)))
                await asyncio.sleep(2.0)  # the first plan loaded
                traffic = Traffic(client, "aa", args.rate, plain_x).start()
                await asyncio.sleep(args.baseline_s)
                before = await traffic.stop()
                tiles, added_ms = ballast_for(
                    args.slow_ms or min(5.0, window_p99_ms(before, args.interval_s)), task, plain_x)
                slow_model = classifier(task.weights, task.bias, ballast=tiles)
                print(f"\nbaseline: {len(before)} requests, p99 {p99_ms(before):.2f} ms (median of "
                      f"{args.interval_s:g} s windows {window_p99_ms(before, args.interval_s):.2f} ms), failed "
                      f"{failures(before) or 0}; the slower version adds {added_ms:.1f} ms of compute a request")
                aa_dir = bundle(workdir / "aa-2", "aa", stable_model, args,
                                rollout_spec(args, args.measurements, limits=args.measurements))
                aa = await roll_out(deployments, log, Traffic(client, "aa", args.rate, plain_x), aa_dir, timeout)
                admin.undeploy("aa")
                print(f"A/A: rollout {aa.ended} after {len(aa.measurements)} measurements, {len(aa.outcomes)} "
                      f"requests ({time.monotonic() - started:.0f} s in)")

                # 3. a worse model, on the drifted slice, judged on the scorer's windows too
                deployments.deploy(model_dir=str(bundle(workdir / "acc-1", "acc", stable_model, args)))
                await asyncio.sleep(2.0)
                poll = ScorerPoll(scorer.target, "acc", (1, 2)).start()
                try:
                    worse = await roll_out(deployments, log, Traffic(client, "acc", args.rate, drift_x, drift_y,
                                                                     monitor=labeller, label_share=args.label_share),
                                           bundle(workdir / "acc-2", "acc", worse_model, args,
                                                  rollout_spec(args, args.quality_count, limits=0, quality=True)),
                                           args.interval_s * (args.quality_count * 3 + 5) + 120)
                finally:
                    scorer_reads = await poll.stop()
                worse_windows = {v: log.windows("acc", v) for v in (1, worse.version)}
                for version in (1, worse.version):  # the scorer's own view, beside the events read above
                    listed = list(labeller.windows("acc", str(version)))
                    print(f"worse model: the scorer lists {len(listed)} windows of version {version} "
                          f"({sum(w.rows for w in listed)} rows, {sum(w.labelled for w in listed)} labels joined; "
                          f"{worse.labelled} labels submitted in all)")
                admin.undeploy("acc")

                # 4. a slower model, --repeats rollouts against the same stable version
                deployments.deploy(model_dir=str(bundle(workdir / "slow-1", "slow", stable_model, args)))
                await asyncio.sleep(2.0)
                slow_runs = []
                for repeat in range(args.repeats):
                    try:
                        slow_runs.append(await roll_out(deployments, log, Traffic(client, "slow", args.rate, plain_x),
                                                        bundle(workdir / f"slow-{repeat + 2}", "slow", slow_model,
                                                               args, rollout_spec(args, args.count, limits=0)),
                                                        args.interval_s * (args.count * 3 + 5) + 60))
                    except FailedPrecondition as refused:
                        print(f"slower model, rollout {repeat + 1}: the deploy was refused: {refused.message}")
                traffic = Traffic(client, "slow", args.rate, plain_x).start()  # the baseline again, after
                await asyncio.sleep(args.baseline_s)
                after = await traffic.stop()
                admin.undeploy("slow")
                placements = [(e.time.timestamp(), e.parse(events.PlacementChanged)) for e in log.events
                              if e.type == events.PlacementChanged.DESCRIPTOR.full_name]
            published = metric(metrics_port, "opml_inference_router_predictions_published_total")
            dropped = metric(metrics_port, "opml_inference_router_predictions_dropped_total")
            shed = {reason: metric(metrics_port, "opml_inference_router_shed_total", reason=reason)
                    for reason in ("queue_full", "deadline", "slo")}
    print(f"done in {time.monotonic() - started:.0f} s, load {os.getloadavg()}; prediction log: {published:.0f} "
          f"published, {dropped:.0f} dropped; shed by admission: {shed}")
    print(f"baseline after: {len(after)} requests, p99 {p99_ms(after):.2f} ms, failed {failures(after) or 0}")
    return report(args, before + after, aa, worse, worse_windows, scorer_reads, slow_runs, placements)


def rollback_chance(p: float, count: int, failure_limit: int) -> float:
    """The chance that more than ``failure_limit`` of ``count`` independent measurements fail, each with ``p``
    (the analysis stops at the first failure past the limit, which does not change the chance)."""
    return 1 - sum(math.comb(count, k) * p ** k * (1 - p) ** (count - k) for k in range(failure_limit + 1))


def client_p99_ratios(run: RolloutRun, seconds: float) -> tuple[list[float], list[int]]:
    """The p99 check over the client's latencies of the run's analysis, in windows of ``seconds``: each
    window's new / stable p99 ratio and its fewer requests of the two versions."""
    start, end = run.analysis_started, run.end[0]
    stable = str(min(int(o.version) for o in run.outcomes if o.version))
    ratios, sizes = [], []
    for index in range(int((end - start) // seconds)):
        window = [o for o in run.outcomes if start + index * seconds <= o.sent < start + (index + 1) * seconds]
        new_n = sum(o.version == str(run.version) for o in window)
        stable_n = sum(o.version == stable for o in window)
        if min(new_n, stable_n) >= 20:
            ratios.append(p99_ms(window, str(run.version)) / p99_ms(window, stable))
            sizes.append(min(new_n, stable_n))
    return ratios, sizes


def describe(run: RolloutRun, placements: list[tuple[float, object]]) -> str:
    """When the run's failures were sent and its placement changes made, in seconds after the deploy call,
    beside where its analysis started and its rollout ended."""
    zero = run.deploy_called
    failed = [o for o in run.outcomes if o.code != "OK"]
    moved = [(t, m) for t, m in placements if zero <= t <= run.end[0] + 1.0]
    text = (f"    deploy called at 0, analysis started +{run.analysis_started - zero:.2f} s, ended "
            f"+{run.end[0] - zero:.2f} s")
    if failed:
        text += (f"; {len(failed)} failed {failures(failed)} sent +{min(o.sent for o in failed) - zero:.2f} to "
                 f"+{max(o.sent for o in failed) - zero:.2f} s, answered in {min(o.latency_s for o in failed):.3f}-"
                 f"{max(o.latency_s for o in failed):.3f} s")
    for t, message in moved:
        text += f"\n    placement changed +{t - zero:.2f} s: {'; '.join(message.reasons) or '(no reason given)'}"
    return text


def evidence_times(windows: dict[int, list[tuple[float, object]]], since: float,
                   check: Check) -> tuple[float, float]:
    """When the scorer's events first gave each version the check's minimum of labels in its windows
    whose last prediction came at or after ``since`` (the router pools them so), and when they first
    made the check fail as the router judges it (nan: never)."""
    ordered = sorted(((t, version, w) for version, found in windows.items() for t, w in found), key=lambda e: e[0])
    kept: dict[int, dict[int, object]] = {version: {} for version in windows}
    enough = math.nan
    stable, new = sorted(windows)
    for t, version, w in ordered:
        if w.last_time.ToNanoseconds() / 1e9 < since:
            continue
        if w.labelled >= getattr(kept[version].get(w.window), "labelled", -1):
            kept[version][w.window] = w
        pooled = {v: Quality(labels=sum(x.labelled for x in found.values() if x.HasField("true_value")),
                             accuracy=(sum(x.true_value * x.labelled for x in found.values()
                                           if x.HasField("true_value")) /
                                       max(1, sum(x.labelled for x in found.values() if x.HasField("true_value")))))
                  for v, found in kept.items()}
        if math.isnan(enough) and min(q.labels for q in pooled.values()) >= check.min_requests:
            enough = t
        idle = Measures(0, 0, None)
        if measure(Analysis(1.0, checks=(check,)), idle, idle, new_quality=pooled[new],
                   stable_quality=pooled[stable])[0] == "FAILED":
            return enough, t
    return enough, math.nan


def read_evidence_times(reads: list[tuple[float, dict[int, list[object]]]], since: float,
                        check: Check) -> tuple[float, float, float]:
    """As :func:`evidence_times`, on the windows read back from the scorer (its open window counting
    as the newest: its labels so far), and the first read from which every later one fails the check
    too: near its bound the evidence can cross it and back (a p-value about 0.01), and a read every
    0.5 s finds a crossing the router, measuring every interval, may not see."""
    enough, first, for_good = math.nan, math.nan, math.nan
    for t, read in reads:
        pooled = {}
        for version, windows in read.items():
            kept = [w for w in windows if w.open or w.last_time.ToNanoseconds() / 1e9 >= since]
            labelled = [w for w in kept if w.labelled and w.HasField("true_value")]
            labels = sum(w.labelled for w in labelled)
            pooled[version] = Quality(labels=labels, accuracy=sum(w.true_value * w.labelled for w in labelled) / labels
                                      if labels else None)
        stable, new = sorted(pooled)
        if math.isnan(enough) and min(q.labels for q in pooled.values()) >= check.min_requests:
            enough = t
        idle = Measures(0, 0, None)
        failing = measure(Analysis(1.0, checks=(check,)), idle, idle, new_quality=pooled[new],
                          stable_quality=pooled[stable])[0] == "FAILED"
        if failing and math.isnan(first):
            first = t
        if failing and math.isnan(for_good):
            for_good = t
        elif not failing:
            for_good = math.nan
    return enough, first, for_good


def report(args: argparse.Namespace, baseline: list[Outcome], aa: RolloutRun, worse: RolloutRun,
           worse_windows: dict[int, list[tuple[float, object]]],
           scorer_reads: list[tuple[float, dict[int, list[object]]]], slow_runs: list[RolloutRun],
           placements: list[tuple[float, object]]) -> int:
    # 2. A/A
    decisions = [m.verdict for m in aa.measurements]
    n = len(decisions)
    false_rollback = decisions.count("FAILED") / n
    false_pause = decisions.count("INCONCLUSIVE") / n
    p99s = [c for c in check(aa.measurements, "p99_latency") if c.verdict != "INCONCLUSIVE"]
    ratios = sorted(c.new_value / c.stable_value for c in p99s)
    errors = check(aa.measurements, "error_rate")
    requests = [c.new_requests for c in errors] + [c.stable_requests for c in errors]
    failed_on = {name: sum(c.verdict == "FAILED" for c in check(aa.measurements, name)) for name in ROUTER_CHECKS}
    print(f"\nA/A: {n} analysis decisions (measurements of {args.interval_s:g} s; "
          f"{min(requests)}-{max(requests)} requests a version, median {statistics.median(requests):.0f})")
    print(f"  verdicts: {decisions.count('PASSED')} passed, {decisions.count('FAILED')} failed "
          f"({', '.join(f'{k} {v}' for k, v in failed_on.items())}), {decisions.count('INCONCLUSIVE')} inconclusive")
    print(f"  p99 new/stable (the router's): median {statistics.median(ratios):.2f}, p90 "
          f"{ratios[int(0.9 * (len(ratios) - 1))]:.2f}, p99 {ratios[int(0.99 * (len(ratios) - 1))]:.2f}, "
          f"max {ratios[-1]:.2f}; stable p99 median {statistics.median(c.stable_value for c in p99s) * 1000:.2f} ms")
    print("  false-rollback rate per decision at other max_ratio bounds (same measurements), and for a rollout of "
          f"{args.count} measurements with failure_limit 0:")
    for bound in sorted({args.max_ratio, 1.25, 1.5, 2.0, 3.0, 5.0}):
        rate = sum(r > bound for r in ratios) / n
        print(f"    max_ratio {bound:4g}: {rate:6.1%} per decision, per rollout "
              f"{rollback_chance(rate, args.count, 0):6.1%} "
              f"(failure_limit 0), {rollback_chance(rate, args.count, 1):6.1%} (failure_limit 1)")
    print(f"  false-rollback rate {false_rollback:.1%} (goal < 1%): {verdict(false_rollback < 0.01)}; "
          f"per rollout of {args.count}: {rollback_chance(false_rollback, args.count, 0):.1%} with failure_limit 0, "
          f"{rollback_chance(false_rollback, args.count, 1):.1%} with 1")
    print(f"  false-pause (inconclusive) rate {false_pause:.1%}")
    print("  the same check on the client's latencies over longer measurements (more requests a version):")
    for intervals in (1, 2, 4, 8):
        ratios_k, sizes = client_p99_ratios(aa, args.interval_s * intervals)
        if len(ratios_k) >= 5:
            print(f"    {args.interval_s * intervals:4g} s, median {statistics.median(sizes):5.0f} requests a version: "
                  f"{len(ratios_k):3d} measurements, failed at max_ratio {args.max_ratio:g} "
                  f"{sum(r > args.max_ratio for r in ratios_k) / len(ratios_k):6.1%}, at 2 "
                  f"{sum(r > 2 for r in ratios_k) / len(ratios_k):6.1%}; max ratio {max(ratios_k):.2f}")
    for m in aa.measurements:
        if m.verdict != "PASSED":
            print(f"    measurement {m.measurement} {m.verdict}: " + "; ".join(
                c.reason for c in m.checks if c.verdict != "PASSED"))
    print(describe(aa, placements))

    # 3. the worse model
    print(f"\nworse model (drifted slice): rollout {worse.ended} after {len(worse.measurements)} measurements "
          f"({', '.join(m.verdict for m in worse.measurements)})")
    for version in ("1", str(worse.version)):
        scored = [o.correct for o in worse.outcomes if o.version == version and o.correct is not None]
        labelled = [o.correct for o in worse.outcomes if o.version == version and o.labelled]
        print(f"  version {version}: accuracy {np.mean(scored):.3f} on {len(scored)} answers ({np.mean(labelled):.3f} on "
              f"the {len(labelled)} labelled), p99 {p99_ms(worse.outcomes, version):.2f} ms")
    failing = {c.check for m in worse.measurements for c in m.checks if c.verdict == "FAILED"}
    back = worse.ended == "ABORTED" and ACCURACY in failing
    print(f"  rolled back for its quality: {verdict(back)} ({worse.ended}; failed checks: "
          f"{', '.join(sorted(failing)) or 'none'}; {getattr(worse.end[1], 'reason', '')})")
    for m in worse.measurements:
        accuracy_check = next((c for c in m.checks if c.check == ACCURACY), None)
        if accuracy_check is not None:
            print(f"    measurement {m.measurement} {m.verdict}: {accuracy_check.verdict} {accuracy_check.reason}")
    for version, found in worse_windows.items():
        closed = sorted({w.window: (t, w) for t, w in found}.values(), key=lambda e: e[0])
        print(f"  scorer: version {version}: {len(closed)} windows announced, {sum(1 for _ in found)} events; "
              + ", ".join(f"#{w.window} {w.rows} rows {w.labelled} labels at +{t - worse.analysis_started:.1f} s"
                          for t, w in closed[:6]))
    new = [o for o in worse.outcomes if o.version == str(worse.version)]
    if worse.ended == "ABORTED" and new:
        back_at = max(o.sent for o in new)
        first = min((o.sent for o in new if o.sent >= worse.analysis_started), default=math.nan)
        accuracy_check = Check(ACCURACY, args.max_drop, args.min_labels)
        enough, by_event = evidence_times(worse_windows, worse.analysis_started, accuracy_check)
        read_enough, by_read, for_good = read_evidence_times(scorer_reads, worse.analysis_started, accuracy_check)
        could = min(by_event, for_good) if not (math.isnan(by_event) or math.isnan(for_good)) else (
            for_good if math.isnan(by_event) else by_event)
        enough = min(enough, read_enough) if not math.isnan(read_enough) else enough
        print(f"  the scorer's evidence fails the accuracy check on the windows since the analysis began: "
              f"by its events +{by_event - worse.analysis_started:.1f} s; by its windows read back (the open "
              f"window's labels too) first +{by_read - worse.analysis_started:.1f} s, and in every read from "
              f"+{for_good - worse.analysis_started:.1f} s after the analysis began")
        print(f"  back on stable {back_at - could:.3f} s after the first of the events' and the reads' for good = "
              f"{(back_at - could) / args.interval_s:.3f} intervals (goal <= 1): "
              f"{verdict(back_at - could <= args.interval_s)}; router: that moment -> RolloutAborted "
              f"{worse.end[0] - could:.3f} s; from the first read failing it "
              f"{(back_at - by_read) / args.interval_s:.3f} intervals")
        print(f"  the scorer's evidence: {args.min_labels} labels of each version +{enough - first:.1f} s after the "
              f"first request the new version answered in the analysis, failing +{could - first:.1f} s; back on "
              f"stable +{back_at - first:.1f} s = {(back_at - first) / args.interval_s:.2f} intervals")
    print(describe(worse, placements))

    # 4. the slower model
    print(f"\nslower model: {len(slow_runs)} rollouts")
    times = []
    for run in slow_runs:
        new = [o for o in run.outcomes if o.version == str(run.version)]
        counted = [o.sent for o in new if o.sent >= run.analysis_started]
        analysed = [o for o in run.outcomes if run.analysis_started <= o.sent <= run.end[0]]
        ratio = p99_ms(analysed, str(run.version)) / p99_ms(analysed, "1")
        line = (f"  version {run.version}: {run.ended} after {len(run.measurements)} measurements "
                f"({', '.join(m.verdict for m in run.measurements)}); p99 while analysed {ratio:.2f}x stable "
                f"(client), router's "
                f"{', '.join(f'{c.new_value / c.stable_value:.2f}x' for c in check(run.measurements, 'p99_latency'))}")
        if run.ended == "ABORTED" and counted:
            seconds = max(o.sent for o in new) - min(counted)
            router_s = run.end[0] - run.analysis_started
            times.append(seconds)
            line += (f"; back on stable {seconds:.3f} s after ({seconds / args.interval_s:.3f} intervals; router "
                     f"{router_s:.3f} s)")
        print(line)
        for c in check(run.measurements, "p99_latency")[:1]:
            print(f"    first p99 check {c.verdict}: {c.reason}")
        print(describe(run, placements))
    if times:
        worst = max(times)
        print(f"  time back on stable: median {statistics.median(times):.3f} s, max {worst:.3f} s = "
              f"{worst / args.interval_s:.3f} intervals (goal <= 1): "
              f"{verdict(len(times) == len(slow_runs) and worst <= args.interval_s)}"
              + ("" if len(times) == len(slow_runs) else f"; {len(slow_runs) - len(times)} not rolled back"))
    else:
        print("  time back on stable: never rolled back: FAIL")

    # 5. the rollout's own errors
    during = aa.outcomes + worse.outcomes + [o for run in slow_runs for o in run.outcomes]
    base_rate = sum(failures(baseline).values()) / len(baseline)
    failed = sum(failures(during).values())
    expected = base_rate * len(during)
    own = max(0.0, failed - expected)
    print(f"\nerrors: baseline {sum(failures(baseline).values())} of {len(baseline)}; during rollouts {failed} of "
          f"{len(during)} {failures(during) or ''}; beyond the baseline's rate {own:.0f} (goal 0): {verdict(own < 1)}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
