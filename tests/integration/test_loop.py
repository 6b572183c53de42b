"""The closed loop across every service that takes part in it, on the real broker, S3 and Redis: the
monitoring-scorer watches the served model, its alert starts the pipeline that pushed it (validate,
train warm, evaluate, bless, push), the inference-router rolls the pushed version out step by step
(a shadow step, then a share of the traffic) and judges it on its own measures and on the scorer's
numbers, and the scorer scores the new version.

One stack serves the module (a bundle-store, a monitoring-scorer, an inference-router with one CPU
worker, a job-orchestrator) and one pipeline; its first run is pushed and serves before the tests.
The first test follows one story from drifted inputs to a promoted version and reads every step's
event back from the bus; the second pushes a version that its pipeline blesses but live traffic
proves worse, and the rollout takes it back while the stable version keeps serving.

The traffic during a rollout is the line's parts as they come (two features, 50 parts a request, a
few requests a second) and the true labels of a sample of them, which the line's quality control
sends a moment later (one request in :data:`LABELLED`, through the scorer's ``SubmitLabels``): what
the rollout's ``accuracy`` check reads. Both are kept low: every 200 labelled rows the scorer refits
its performance predictor in line (in its labels agent, and in its predictions agent for labels
that came first), and on a loaded 2-core machine a label for every other request kept its windows
minutes behind the traffic; one in ten still keeps the labels behind it under load, which is where
this module's time goes (1.5 to 6 minutes in all)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
import yaml
from aiokafka import AIOKafkaConsumer
from opml.bundles.v1 import bundles_pb2
from opml.bundles.v1 import events_pb2 as bundle_events
from opml.inference.v1 import deployment_events_pb2 as rollout_events
from opml.inference.v1 import deployments_pb2 as deploy_pb
from opml.jobs.v1 import pipeline_events_pb2 as pipeline_events
from opml.jobs.v1 import pipelines_pb2 as pb
from opml.monitoring.v1 import alert_events_pb2, quality_events_pb2
from tritonclient.utils import InferenceServerException

from opml_bundle_store_contract.client import BundleStoreClient
from opml_bundle_store_contract.topics import BUNDLES
from opml_bundle_store_contract.values import value_from_proto
from opml_common.bus import CloudEvent, kafka_client_kwargs
from opml_common.config import PlatformSettings
from opml_common.errors import NotFound
from opml_devstack.devinfra import Endpoints
from opml_devstack.testing.bus import poll_until
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_inference_router_contract.client import DeploymentClient
from opml_inference_router_contract.topics import DEPLOYMENTS
from opml_job_orchestrator_contract.pipelineclient import PipelineClient
from opml_job_orchestrator_contract.pipelinespec import load_pipeline
from opml_job_orchestrator_contract.topics import PIPELINES
from opml_monitoring_scorer_contract.client import MonitoringClient
from opml_monitoring_scorer_contract.topics import ALERTS, QUALITY

pytestmark = pytest.mark.timeout(900)  # per test; the module's stack and first run come with the first one

TRAIN = Path(__file__).parent / "programs" / "pipeline_train.py"
NODE = {"name": "n0", "cpu_millis": 8000, "memory_mib": 8192, "gpu": 0}
FLEET = {  # room for the stable version, the one rolled out and the one that retires on a promotion
    "pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 4, "cost_per_hour": 0.4,
                    "execution_provider": "CPUExecutionProvider"}],
    "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}],
}
MODEL = "quality"
ROWS = 50
"""Parts a request: the windows of 1,000 predictions the pipeline's monitoring.yaml sets close on whole requests."""
LABELLED = 10
"""One request in this many is labelled."""
ROLLOUT = {"steps": [
    {"shadow": {"percent": 50}},
    # a retrained model is meant to answer differently here and there: the shadow step stops one that
    # fails or answers differently on a quarter of the parts, not one a few points worse
    {"analysis": {"interval_s": 5, "count": 1, "inconclusive_limit": 10_000, "checks": {
        "error_rate": {"max_increase": 0.05, "min_requests": 10},
        "disagreement": {"max_share": 0.25, "min_requests": 10}}}},
    {"weight": 50},
    {"analysis": {"interval_s": 5, "count": 1, "inconclusive_limit": 10_000, "checks": {
        "error_rate": {"max_increase": 0.05, "min_requests": 10},
        "estimated_accuracy": {"max_drop": 0.1, "min_predictions": 1000},
        "accuracy": {"max_drop": 0.05, "min_labels": 200}}}},
]}
STEPS = ["spans", "check", "fit", "judge", "gate", "ship"]


def span_csv(seed: int, *, cut: float = 0.0, rows: int = 1000) -> bytes:
    """A labelled span of the line: a part is good (label 1) when x1 + x2 > ``cut``; the line's rule is 0."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 2))
    out = io.StringIO()
    out.write("x1,x2,line,label\n")
    for (a, b), line in zip(x, rng.integers(0, 2, rows), strict=True):
        out.write(f"{a:.6f},{b:.6f},line-{line},{int(a + b > cut)}\n")
    return out.getvalue().encode()


def pipeline_spec() -> pb.PipelineSpec:
    """Retrained on the newest span when its served model alerts, judged on that span (and against the
    blessed model on it), pushed with :data:`ROLLOUT`."""
    return load_pipeline({
        "name": MODEL,
        "triggers": {"on_span": False, "on_alert": True},
        "steps": [
            {"name": "spans", "kind": "ingest", "ingest": {"context": "data", "bundle_name": "inspections"}},
            {"name": "check", "kind": "validate", "inputs": ["spans"], "validate": {
                "label": "label", "thresholds": {"default": {"jensen_shannon_divergence": 0.5}}}},
            {"name": "fit", "kind": "train", "inputs": ["spans", "check"], "train": {
                "class": "TE", "command": [sys.executable, str(TRAIN)], "warm_start": True,
                "resources": {"cpu": 1, "memory": "512Mi"}}},
            {"name": "judge", "kind": "evaluate", "inputs": ["fit", "spans"], "evaluate": {
                "label": "label", "features": ["x1", "x2"], "slices": ["line"], "metrics": ["accuracy"],
                "thresholds": [{"metric": "accuracy", "lower": 0.8},
                               {"metric": "accuracy", "change": {"direction": "higher_is_better", "absolute": -0.02},
                                "slices": False}]}},
            {"name": "gate", "kind": "bless", "inputs": ["judge"]},
            {"name": "ship", "kind": "push", "inputs": ["gate"], "push": {
                "context": "serving", "model": MODEL, "rollout": ROLLOUT}},
        ],
    })


@dataclass
class Loop:
    """The module's stack, its clients, and where its events are."""

    settings: PlatformSettings
    router: str
    store: BundleStoreClient
    pipelines: PipelineClient
    deployments: DeploymentClient
    monitoring: MonitoringClient
    spans: int = 1

    def commit_span(self, data: bytes) -> str:
        self.spans += 1
        return self.store.add("data", "inspections", {"part-0.csv": data}, tags={"span": str(self.spans)},
                              commit=True).uuid

    def ended_run(self, number: int, timeout_s: float = 300) -> pb.PipelineRun:
        def ended() -> pb.PipelineRun | None:
            runs = [r for r in self.pipelines.runs(MODEL) if r.number == number]
            return runs[0] if runs and runs[0].state != pb.RUN_STATE_RUNNING else None
        return poll_until(ended, timeout_s=timeout_s, every_s=0.2, what=f"run {number} of pipeline {MODEL} to end")

    def versions(self) -> dict[int, deploy_pb.ModelVersionStatus]:
        try:
            return {v.version: v for v in self.deployments.get(MODEL).versions}
        except NotFound:
            return {}

    def serving(self, version: int) -> bool:
        found = self.versions().get(version)
        return found is not None and found.state == deploy_pb.SERVING

    def stable(self) -> int:
        """The version that keeps the traffic a rollout does not take."""
        return self.deployments.get(MODEL).stable_version

    def rollout_ended(self, version: int, timeout_s: float = 600) -> deploy_pb.Rollout:
        def ended() -> deploy_pb.Rollout | None:
            try:
                rollout = self.deployments.get_rollout(MODEL)
            except NotFound:
                return None
            return rollout if rollout.version == version and rollout.phase not in ("RUNNING", "PAUSED") else None
        return poll_until(ended, timeout_s=timeout_s, every_s=0.5, what=f"the rollout of {MODEL} v{version} to end")

    def monitored(self, version: int) -> bool:
        try:
            self.monitoring.status(MODEL, str(version))
            return True
        except NotFound:
            return False


@pytest.fixture(scope="module")
def loop(infra: Endpoints, run_id: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loop]:
    """The stack, the pipeline applied, and its first run (span 1, by hand) serving as version 1."""
    prefix = f"t{run_id}-{uuid.uuid4().hex[:6]}-"  # as the `unique_prefix` fixture makes it, for the module
    settings_env = {**infra.env(), "OPML_TOPIC_PREFIX": prefix, "OPML_REDIS_PREFIX": f"opml-test:{prefix}",
                    "OPML_KAFKA_SESSION_TIMEOUT_MS": "2000", "OPML_KAFKA_HEARTBEAT_INTERVAL_MS": "500",
                    "OPML_LOG_FORMAT": "text"}
    home = tmp_path_factory.mktemp("loop")
    job_dir = Path(tempfile.mkdtemp(prefix="opml-job-"))  # as the `job_dir` fixture makes it: sandboxed jobs read it
    job_dir.chmod(0o777)
    (home / "fleet.yaml").write_text(yaml.safe_dump(FLEET))
    start = ServiceStarter(settings_env, home)
    try:
        store = start("bundle-store")
        scorer = start("monitoring-scorer", extra_env={
            "OPML_MONITORING_SCORER_BUNDLE_STORE_TARGET": store.target,
            "OPML_MONITORING_SCORER_BUNDLE_STORE_TOKEN": TOKENS["reader"]})
        router = start("inference-router", extra_env={
            "OPML_INFERENCE_ROUTER_FLEET": str(home / "fleet.yaml"),
            "OPML_INFERENCE_ROUTER_BUNDLE_STORE_TARGET": store.target,
            "OPML_INFERENCE_ROUTER_BUNDLE_STORE_TOKEN": TOKENS["writer"],  # the rollout's decisions are written
            "OPML_INFERENCE_ROUTER_MONITORING_SCORER_TARGET": scorer.target,
            "OPML_INFERENCE_ROUTER_MONITORING_SCORER_TOKEN": TOKENS["reader"],
            "OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA": "1"})
        orchestrator = start("job-orchestrator", extra_env={
            "OPML_JOB_ORCHESTRATOR_NODES": json.dumps([NODE]),
            "OPML_JOB_ORCHESTRATOR_BUNDLE_STORE_TARGET": store.target,
            "OPML_JOB_ORCHESTRATOR_BUNDLE_STORE_TOKEN": TOKENS["writer"],
            "OPML_JOB_ORCHESTRATOR_MONITORING_SCORER_TARGET": scorer.target,
            "OPML_JOB_ORCHESTRATOR_MONITORING_SCORER_TOKEN": TOKENS["reader"],
            "OPML_JOB_ORCHESTRATOR_PIPELINE_DIR": str(job_dir / "pipelines")})
        with BundleStoreClient(store.target, token=TOKENS["writer"]) as store_client, \
                PipelineClient(orchestrator.target, token=TOKENS["writer"]) as pipelines, \
                DeploymentClient(router.target, token=TOKENS["reader"]) as deployments, \
                MonitoringClient(scorer.target, token=TOKENS["reader"]) as monitoring:
            settings = PlatformSettings(kafka_bootstrap=infra.kafka_bootstrap, topic_prefix=prefix)
            loop = Loop(settings, router.target, store_client, pipelines, deployments, monitoring)
            store_client.create_context("data")
            pipelines.apply(pipeline_spec())
            store_client.add("data", "inspections", {"part-0.csv": span_csv(1)}, tags={"span": "1"}, commit=True)
            assert pipelines.trigger(MODEL, reason="the first model").run == 1
            first = loop.ended_run(1)
            assert first.state == pb.RUN_STATE_SUCCEEDED and first.blessed, first
            poll_until(lambda: loop.serving(1), timeout_s=120, what=f"{MODEL} v1 serving")
            poll_until(lambda: loop.monitored(1), timeout_s=120, what=f"{MODEL} v1 monitored")
            yield loop
    finally:
        start.stop_all()
        shutil.rmtree(job_dir, ignore_errors=True)


@dataclass
class Served:
    """What the traffic saw: answers by the version that gave them, failed requests and why."""

    by_version: Counter = field(default_factory=Counter)
    failed: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answered(self, version: int) -> int:
        with self.lock:
            return self.by_version[version]


@contextlib.contextmanager
def traffic(loop: Loop, tag: str, *, seed: int) -> Iterator[Served]:
    """Requests of :data:`ROWS` parts from a thread, about ten a second, until the block ends, and the
    true labels (the line's rule, x1 + x2 > 0) of one request in :data:`LABELLED`, sent to the scorer
    five at a time; nothing a request raises stops it (it is counted)."""
    stop, served = threading.Event(), Served()
    rng = np.random.default_rng(seed)
    headers = {"authorization": f"Bearer {TOKENS['writer']}"}

    def send() -> None:
        labels: list[tuple[str, list[float], None]] = []
        with triton.InferenceServerClient(loop.router) as client, \
                MonitoringClient(loop.monitoring.target, token=TOKENS["writer"]) as labeller:
            for number in range(1_000_000):
                if stop.wait(0.1):
                    break
                parts = rng.normal(size=(ROWS, 2)).astype(np.float32)
                tensor = triton.InferInput("features", [ROWS, 2], "FP32")
                tensor.set_data_from_numpy(parts)
                request_id = f"{tag}-{number}"
                try:  # a deadline of its own: the model's default (200 ms) is a latency bound two loaded
                    # cores miss while a new version is profiled beside the traffic; this counts failures
                    answer = client.infer(MODEL, [tensor], request_id=request_id, headers=headers, client_timeout=30)
                except InferenceServerException as error:
                    with served.lock:
                        served.failed.append(str(error))
                    continue
                with served.lock:
                    served.by_version[int(answer.get_response().model_version or 0)] += 1
                if number % LABELLED == 0:
                    labels.append((request_id, [float(v) for v in (parts.sum(axis=1) > 0)], None))
                if len(labels) == 5:
                    labeller.submit_labels(MODEL, labels)
                    labels.clear()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        yield served
    finally:
        stop.set()
        thread.join(timeout=60)


def send_drifted(loop: Loop, requests: int) -> None:
    """The line's sensors fail: every feature reads 50, far outside anything the model was trained on."""
    rows = np.full((ROWS, 2), 50.0, dtype=np.float32)
    with triton.InferenceServerClient(loop.router) as client:
        for _ in range(requests):
            tensor = triton.InferInput("features", [ROWS, 2], "FP32")
            tensor.set_data_from_numpy(rows)
            client.infer(MODEL, [tensor], headers={"authorization": f"Bearer {TOKENS['writer']}"})


async def _read_until(settings: PlatformSettings, topics: list[str],
                      done: Callable[[list[CloudEvent]], bool], timeout_s: float) -> list[CloudEvent]:
    consumer = AIOKafkaConsumer(*topics, **kafka_client_kwargs(settings), group_id=None,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    events: list[CloudEvent] = []
    try:
        deadline = time.monotonic() + timeout_s
        while not done(events):
            left = deadline - time.monotonic()
            if left <= 0:
                kinds = Counter(e.type.rsplit(".", 1)[1] for e in events)
                raise AssertionError(f"the events awaited did not all come in {timeout_s} s; read: {dict(kinds)}")
            for part in (await consumer.getmany(timeout_ms=int(min(left, 0.5) * 1000))).values():
                events.extend(CloudEvent.from_kafka(r.headers, r.value) for r in part)
    finally:
        await consumer.stop()
    return events


def read_events(loop: Loop, done: Callable[[list[CloudEvent]], bool], timeout_s: float = 120) -> list[CloudEvent]:
    """Every event of the loop's topics from their start, once ``done`` holds for what was read."""
    prefix = loop.settings.topic_prefix
    topics = [t.full_name(prefix) for t in (ALERTS, PIPELINES, BUNDLES, DEPLOYMENTS, QUALITY)]
    return asyncio.run(_read_until(loop.settings, topics, done, timeout_s))


def of(events: list[CloudEvent], kind: type, where: Callable = lambda message: True) -> list[tuple[CloudEvent, object]]:
    """The events of one message type whose message satisfies ``where``, with their messages, in time order."""
    found = [(e, e.parse(kind)) for e in events if e.type == kind.DESCRIPTOR.full_name]
    return sorted(((e, m) for e, m in found if where(m)), key=lambda pair: pair[0].time)


def test_drift_alerts_the_pipeline_retrains_and_the_rollout_promotes_with_every_event_on_the_bus(loop: Loop) -> None:
    """The line's sensors fail and the served model's inputs go far out of range -> the scorer raises
    its bad-input alert -> the pipeline that pushed the model runs on the newest span (the alert its
    trigger), validates it, trains warm from the blessed model, evaluates, blesses and pushes -> the
    router deploys the pushed bundle beside the stable version and rolls it out: a shadow step judged
    on errors and disagreement, then half the traffic judged on errors, the scorer's estimate and the
    accuracy the late labels give -> promoted. The sensors are repaired once the run started (the
    orchestrator asks the scorer whether the alert still fires before it starts one): the rollout is
    judged on the line's real traffic. Every step's event is then read back from the bus,
    and each chain of them is in the order the loop runs."""
    stable = loop.stable()
    loop.commit_span(span_csv(loop.spans + 1))  # the line's newest labelled span, no run yet (on_span is off)
    runs_before = max(r.number for r in loop.pipelines.runs(MODEL))
    send_drifted(loop, 1000 // ROWS)  # one monitoring window, exactly

    def run_started() -> pb.PipelineRun | None:
        return next((r for r in loop.pipelines.runs(MODEL) if r.number > runs_before), None)
    run = poll_until(run_started, timeout_s=240, what="a run of the pipeline started by the alert")
    ended = loop.ended_run(run.number)
    assert ended.state == pb.RUN_STATE_SUCCEEDED and ended.blessed, ended.message
    with traffic(loop, "promote", seed=5) as served:  # the sensors repaired: the line's parts again
        new = stable + 1
        rollout = loop.rollout_ended(new)
    assert rollout.phase == "PROMOTED", rollout
    assert served.failed == [], served.failed[:3]
    assert served.answered(new) > 0 and loop.stable() == new
    assert loop.versions()[new].state == deploy_pb.SERVING

    def complete(events: list[CloudEvent]) -> bool:
        return bool(of(events, pipeline_events.PipelineRunFinished, lambda m: m.run.number == run.number)
                    and of(events, rollout_events.RolloutPromoted, lambda m: m.version == new)
                    and of(events, quality_events_pb2.WindowScored, lambda m: m.version == str(new)))
    events = read_events(loop, complete)

    # the scorer's alert on the served version, and the run it started
    [(alert_event, alert)] = of(events, alert_events_pb2.AlertRaised)
    assert (alert.model, alert.version, alert.rule) == (MODEL, str(stable), "bad-input"), alert
    assert [t.startswith(f"alert: {MODEL} version {stable} rule bad-input") for t in ended.triggers] == [True], \
        ended.triggers
    ours = lambda m: m.run.number == run.number  # noqa: E731
    [(started_event, _)] = of(events, pipeline_events.PipelineRunStarted, ours)
    finished_steps = of(events, pipeline_events.PipelineStepFinished, ours)
    assert [m.step for _, m in finished_steps] == STEPS
    step_records = {s.step: s for s in finished_steps[-1][1].run.steps}
    assert all(s.state == pb.STEP_STATE_SUCCEEDED for s in step_records.values()), step_records
    assert step_records["fit"].details["start"] == "warm", step_records["fit"]
    [(run_finished_event, run_finished)] = of(events, pipeline_events.PipelineRunFinished, ours)
    assert run_finished.run.state == pb.RUN_STATE_SUCCEEDED and run_finished.run.blessed

    # the serving bundle the push committed, which the router deployed and rolled out
    [(committed_event, committed)] = of(events, bundle_events.BundleCommitted, lambda m: (
        m.bundle.tags.get("pipeline-run") == str(run.number) and m.bundle.tags.get("pipeline-output") == "serving"))
    assert committed.bundle.tags["serve"] == "true"
    assert {"model.onnx", "model.yaml", "rollout.yaml", "reference.npz", "monitoring.yaml"} <= {
        f.path for f in committed.bundle.files}
    [(deployed_event, deployed)] = of(events, rollout_events.ModelDeployed, lambda m: m.version == new)
    assert deployed.deployment.name.endswith(MODEL)
    # the rollout as the router walked it: each step, each analysis's verdict, each traffic change
    rollout_kinds = (rollout_events.RolloutStepStarted, rollout_events.RolloutAnalysisCompleted,
                     rollout_events.RolloutPaused, rollout_events.RolloutAborted, rollout_events.RolloutPromoted)
    walked = sorted([*(pair for kind in rollout_kinds for pair in of(events, kind, lambda m: m.version == new)),
                     *of(events, rollout_events.TrafficChanged, lambda m: m.model == MODEL)],
                    key=lambda pair: pair[0].time)
    walked = [(e, m) for e, m in walked if e.time > deployed_event.time]
    analyses = [m for _, m in walked if isinstance(m, rollout_events.RolloutAnalysisCompleted)]
    assert all(m.verdict == "INCONCLUSIVE" for m in analyses if m.verdict != "PASSED"), analyses
    assert {m.step for m in analyses} == {1, 3}, "every measurement at an analysis step"
    assert [_rollout_entry(m) for _, m in walked if getattr(m, "verdict", "") != "INCONCLUSIVE"] == [
        ("step", 0, "shadow"), ("step", 1, "analysis"), ("analysis", 1, "PASSED"), ("step", 2, "weight"),
        ("traffic", "rollout", {stable: 50.0, new: 50.0}), ("step", 3, "analysis"), ("analysis", 3, "PASSED"),
        ("traffic", "promote", {new: 100.0}), ("promoted",)]
    passed = {m.step: {c.check: c for c in m.checks} for m in analyses if m.verdict == "PASSED"}
    assert set(passed[1]) == {"error_rate", "disagreement"} and set(passed[3]) == {
        "error_rate", "estimated_accuracy", "accuracy"}
    assert passed[1]["disagreement"].new_value <= 0.25 and passed[3]["accuracy"].new_value >= 0.9, passed
    weight_started = next(e for e, m in walked if isinstance(m, rollout_events.RolloutStepStarted) and m.step == 2)
    promoted_event = walked[-1][0]

    # the new version's windows, scored from the traffic the weight step sent it
    windows = of(events, quality_events_pb2.WindowScored, lambda m: m.model == MODEL and m.version == str(new))
    first_window = windows[0][0]

    # each chain in the order the loop runs it (one clock: every process is on this machine)
    pipeline_chain = [alert_event, started_event, *[e for e, _ in finished_steps[:5]], committed_event,
                      finished_steps[5][0], run_finished_event]
    assert [e.time for e in pipeline_chain] == sorted(e.time for e in pipeline_chain), [
        (e.type, e.time) for e in pipeline_chain]
    rollout_chain = [committed_event, deployed_event, *[e for e, _ in walked]]
    assert [e.time for e in rollout_chain] == sorted(e.time for e in rollout_chain)
    assert weight_started.time <= first_window.time <= promoted_event.time


def _rollout_entry(message) -> tuple:
    """A rollout event (or a traffic change) as the test compares it."""
    if isinstance(message, rollout_events.RolloutStepStarted):
        return "step", message.step, message.spec.kind
    if isinstance(message, rollout_events.RolloutAnalysisCompleted):
        return "analysis", message.step, message.verdict
    if isinstance(message, rollout_events.TrafficChanged):
        return "traffic", message.cause, {int(v): p for v, p in message.traffic_percent.items()}
    return (type(message).__name__.removeprefix("Rollout").lower(),)


def test_a_version_blessed_on_mislabelled_data_is_rolled_back_on_live_labels_while_the_stable_one_serves(
        loop: Loop) -> None:
    """The newest span's labels were made by a quality station set by mistake to a stricter rule
    (x1 + x2 > 0.5 where the line's rule is 0): a model trained on it learns that boundary, is right on
    almost every part of the span it is evaluated on (which carries the same labels), beats the blessed
    model there, and is blessed and pushed. On the line it calls good parts bad: about one part in seven
    differs from the stable version, within the shadow step's bound (a retrained model may answer
    differently), and its label-free estimate stays as high as the stable one's, since its reference
    set carries the same wrong labels. The line's own labels, sent as parts are inspected, tell: the
    `accuracy` check of the weight step fails, the rollout is aborted, the traffic is back on the
    stable version, which kept serving throughout (no request failed), and the new version is retired,
    the failing check in the rollout, its event and its decision in the bundle's lineage."""
    stable = loop.stable()
    loop.commit_span(span_csv(loop.spans + 1, cut=0.5))
    with traffic(loop, "rollback", seed=6) as served:
        number = loop.pipelines.trigger(MODEL, reason="the newest span").run
        run = loop.ended_run(number)
        assert run.state == pb.RUN_STATE_SUCCEEDED and run.blessed, run.message
        new = stable + 1
        rollout = loop.rollout_ended(new)
        answered = served.answered(stable)
        poll_until(lambda: served.answered(stable) >= answered + 20, timeout_s=120,
                   what=f"v{stable} answering after the rollback")
    assert rollout.phase == "ABORTED", rollout
    checks = {c.check: c for c in rollout.checks}
    assert checks["accuracy"].verdict == "FAILED", rollout
    assert checks["accuracy"].stable_value - checks["accuracy"].new_value > 0.05, checks["accuracy"]
    assert checks["estimated_accuracy"].verdict == "PASSED", checks["estimated_accuracy"]
    assert "accuracy" in rollout.reason
    assert served.failed == [], served.failed[:3]
    assert served.answered(new) > 0, "the new version took its share before it was rolled back"
    assert {n: v.traffic_percent for n, v in loop.versions().items()} == {stable: 100}

    def aborted(events: list[CloudEvent]) -> bool:
        return bool(of(events, rollout_events.RolloutAborted, lambda m: m.version == new))
    [(_, event)] = of(read_events(loop, aborted), rollout_events.RolloutAborted, lambda m: m.version == new)
    assert event.stable_version == stable and "accuracy" in event.reason
    assert {c.check: c.verdict for c in event.checks}["accuracy"] == "FAILED"

    [bundle] = [b for b in loop.store.list_bundles("serving", tags={"pipeline-run": str(number)})
                if b.tags.get("pipeline-output") == "serving"]

    def decisions() -> dict[str, dict] | None:
        graph = loop.store.lineage("serving", bundle.uuid, direction=bundles_pb2.GetLineageRequest.DOWNSTREAM)
        found = {b.bundle_name: {k: value_from_proto(v) for k, v in b.values.items()}
                 for b in graph.bundles if b.uuid != bundle.uuid}
        return found if any(name.endswith(".aborted") for name in found) else None
    found = poll_until(decisions, timeout_s=60, what="the rollout's decisions in the new bundle's lineage")
    [outcome] = [values for name, values in found.items() if name.endswith(".aborted")]
    assert outcome["verdict"] == "ABORTED" and outcome["accuracy.verdict"] == "FAILED", outcome
