"""Fixtures: a real bundle-store holding a reference bundle, a real monitoring-scorer, and a producer of
PredictionMade events built by the inference-router's own prediction log (``PredictionLog.event_of``),
published to the real broker, or of one-row requests queued on that log and published by its own
senders (batched per version as the router does: PredictionBatch records), and of LabelObserved events."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer
from opml.inference.v1 import events_pb2 as inference_events
from opml.monitoring.v1 import label_events_pb2
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2 as pb

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.bus import EventPublisher
from opml_common.bus.cloudevents import CloudEvent
from opml_common.bus.security import kafka_client_kwargs
from opml_common.config import PlatformSettings
from opml_common.kserve_codec import encode_outputs, encode_request
from opml_common.metrics import ServiceMetrics
from opml_devstack.process import ServiceProcess
from opml_devstack.testing.bus import sample
from opml_devstack.testing.services import TOKENS, ServiceStarter, env_prefix
from opml_inference_router.predictions import PredictionLog, _Entry
from opml_inference_router.routing import Routed
from opml_monitoring_scorer.__main__ import SPEC
from opml_monitoring_scorer.client import MonitoringClient
from opml_monitoring_scorer.core.reference import Task
from opml_monitoring_scorer.core.scorer import dump_reference
from opml_monitoring_scorer.synthetic import FEATURES, Rows, SyntheticWorld
from opml_monitoring_scorer.topics import LABELS, PREDICTIONS

SRC = str(Path(__file__).resolve().parents[1] / "src")
WINDOW = 200
BATCH = 10
CONFIG = f"""
features: {{x: [{", ".join(FEATURES)}]}}
outputs: {{scores: probabilities}}
window: {{count: {WINDOW}}}
rules:
  - {{name: drift, signal: drift, over: 0.25, for: 2, clear_after: 2, margin: 0.05}}
  - {{name: accuracy, signal: mpp, under: 0.7, for: 2}}
"""


@dataclass
class Stack:
    store: ServiceProcess
    scorer_env: dict[str, str]
    starter: ServiceStarter
    context: str

    def scorer(self) -> ServiceProcess:
        process = self.starter(SPEC, env=self.scorer_env, start=False)
        # a scorer trains its monitors before it serves: on a shared, loaded machine 60 s was not always enough
        process.startup_timeout_s = 180.0
        return process

    def another_scorer(self) -> ServiceProcess:
        """A second scorer process in the same consumer group (same topics, Redis and bundle-store) on
        ports and a home of its own."""
        fresh = self.starter.env(SPEC)
        own = [f"{env_prefix(SPEC)}{name}" for name in ("GRPC_PORT", "METRICS_PORT", "HOME")]
        process = self.starter(SPEC, env={**self.scorer_env, **{k: fresh[k] for k in own}}, start=False)
        process.startup_timeout_s = 180.0
        return process


@pytest.fixture
def world() -> SyntheticWorld:
    return SyntheticWorld(Task.BINARY, seed=11)


@pytest.fixture
def stack(start_service: ServiceStarter, world: SyntheticWorld, unique_prefix: str) -> Iterator[Stack]:
    """A bundle-store with the reference bundle ``reference`` committed in context ``monitoring``, and the
    environment of a monitoring-scorer pointed at it (started by the test)."""
    store = start_service("bundle-store")
    context = "monitoring"
    with BundleStoreClient(store.target, token=TOKENS["writer"]) as client:
        client.create_context(context)
        client.add(context, "reference", {"reference.npz": dump_reference(world.reference(3000)),
                                          "monitoring.yaml": CONFIG.encode()}, commit=True)
    env = start_service.env(SPEC, extra_env={
        "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH", "")) if p),
        "OPML_MONITORING_SCORER_BUNDLE_STORE_TARGET": store.target,
        "OPML_MONITORING_SCORER_BUNDLE_STORE_TOKEN": TOKENS["reader"],
        "OPML_MONITORING_SCORER_SHUTDOWN_GRACE_S": "1"})
    yield Stack(store, env, start_service, context)


def writer(process: ServiceProcess) -> MonitoringClient:
    return MonitoringClient(process.target, token=TOKENS["writer"])


class Producer:
    """Publishes predictions as the router's PredictionLog makes them (``send``: requests of BATCH rows,
    one PredictionMade record each; ``queue``: one-row requests queued on the log, whose senders publish
    what is queued for the version as one record, up to ``batch_max``), and labels. ``record_cap_bytes``:
    the log's record cap (0: every prediction carries summaries only, as large tensors do)."""

    def __init__(self, settings: PlatformSettings, model: str = "fraud", version: str = "1", *,
                 batch_max: int = 100, ids: str = "req", record_cap_bytes: int = 64 * 1024) -> None:
        self.settings = settings
        self.model, self.version, self.ids = model, version, ids
        self.registry = CollectorRegistry()
        self.publisher = EventPublisher(settings, source="opml/inference-router",
                                        metrics=ServiceMetrics("test", self.registry))
        # named as the router's, so its counters are the router's (opml_inference_router_predictions_*)
        self.log = PredictionLog(self.publisher, ServiceMetrics("inference-router", self.registry),
                                 batch_max=batch_max, record_cap_bytes=record_cap_bytes)
        self.sent = 0
        self.labels: dict[str, list[float]] = {}

    async def __aenter__(self) -> Producer:
        await self.publisher.start()
        await self.log.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.log.stop()
        await self.publisher.stop()

    async def queue(self, rows: Rows, *, times: np.ndarray | None = None, chunk: int | None = None) -> None:
        """One-row requests queued on the log as the router's request path does (``times``: when each was
        received; default now), ``chunk`` at a time (default all at once), each chunk published (the
        broker acknowledged every prediction) before the next is queued."""
        n = len(rows.outputs)
        x = np.column_stack([rows.features[f] for f in FEATURES]).astype(np.float32)
        color = rows.features["color"].astype(object)
        scores = rows.outputs.class_scores().astype(np.float32)
        routed = Routed(b"", self.version, "127.0.0.1:1", 1, False)
        chunk = chunk or n
        for begin in range(0, n, chunk):
            for i in range(begin, min(begin + chunk, n)):
                request_id = f"{self.ids}-{self.sent}"
                request = encode_request(self.model, {"x": x[i:i + 1], "color": np.array([[color[i].encode()]],
                                                                                          dtype=object)},
                                         version=self.version, request_id=request_id)
                response = encode_outputs(pb.ModelInferResponse(model_name=self.model, model_version=self.version,
                                                                id=request_id), {"probabilities": scores[i:i + 1]})
                self.log.record(request_id=request_id, model=self.model, routed=routed,
                                request=request.SerializeToString(), response=response.SerializeToString(),
                                received=time.time() if times is None else times[i], latency_s=0.001)
                self.labels[request_id] = [float(rows.labels[i])]
                self.sent += 1
            deadline = time.monotonic() + 120
            while self.published() < self.sent:  # the senders' publishes acknowledged (a failed one is dropped)
                assert not self.dropped(), "the prediction log dropped predictions"
                assert time.monotonic() < deadline, f"{self.published():.0f} of {self.sent} predictions published"
                await asyncio.sleep(0.01)

    def published(self) -> float:
        return sample(self.registry, "opml_inference_router_predictions_published_total")

    def dropped(self) -> float:
        return sum(sample(self.registry, "opml_inference_router_predictions_dropped_total", reason=reason)
                   for reason in ("queue_full", "publish_failed", "shutdown"))

    async def send(self, rows: Rows, *, start: int = 0) -> None:
        n = len(rows.outputs)
        x = np.column_stack([rows.features[f] for f in FEATURES]).astype(np.float32)
        color = rows.features["color"].astype(object)
        scores = rows.outputs.class_scores().astype(np.float32)
        for i in range(0, n, BATCH):
            request_id = f"{self.ids}-{self.sent}"
            request = encode_request(self.model, {"x": x[i:i + BATCH],
                                                  "color": np.array([[c.encode()] for c in color[i:i + BATCH]],
                                                                    dtype=object)},
                                     version=self.version, request_id=request_id)
            response = encode_outputs(pb.ModelInferResponse(model_name=self.model, model_version=self.version,
                                                            id=request_id),
                                      {"probabilities": scores[i:i + BATCH]})
            entry = _Entry(request_id, self.model, time.time(), 0.001,
                           Routed(b"", self.version, "127.0.0.1:1", 1, False),
                           request.SerializeToString(), response.SerializeToString())
            await self.publisher.publish_proto(PREDICTIONS, self.log.event_of(entry),
                                               subject=f"{self.model}/{self.version}")
            self.labels[request_id] = [float(v) for v in rows.labels[i:i + BATCH]]
            self.sent += 1

    async def send_labels(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            label = label_events_pb2.LabelObserved(request_id=request_id, values=self.labels[request_id])
            await self.publisher.publish(LABELS, CloudEvent.from_proto(label, source="opml/test-labels",
                                                                       subject=request_id), key=request_id)


def wait_windows(client: MonitoringClient, model: str, version: str, count: int, *, timeout_s: float = 180.0,
                 process: ServiceProcess | None = None) -> list:
    """The version's windows once ``count`` are closed (oldest first); polls the API up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    windows: list = []
    while time.monotonic() < deadline:
        windows = sorted(client.windows(model, version, page_size=1000), key=lambda w: w.index)
        if len(windows) >= count:
            return windows
        time.sleep(0.2)
    log = process.log_path.read_text()[-3000:] if process is not None else ""
    raise AssertionError(f"{len(windows)} of {count} windows closed in {timeout_s}s\n{log}")


def wait_labelled(client: MonitoringClient, model: str, version: str, indexes: list[int], *,
                  timeout_s: float = 180.0) -> list:
    """The windows ``indexes`` once every row of each has its label joined; polls the API."""
    deadline = time.monotonic() + timeout_s
    found: list = []
    while time.monotonic() < deadline:
        windows = {w.index: w for w in client.windows(model, version, page_size=1000)}
        found = [windows[i] for i in indexes if i in windows and windows[i].labelled == windows[i].rows]
        if len(found) == len(indexes):
            return found
        time.sleep(0.2)
    raise AssertionError(f"{len(found)} of {len(indexes)} windows fully labelled in {timeout_s}s")


async def read_predictions(settings: PlatformSettings, total: int, *, timeout_s: float = 60.0,
                           ) -> list[tuple[str, list[inference_events.PredictionMade]]]:
    """The predictions topic from the beginning, record by record in offset order (one partition per
    version), until ``total`` predictions were read: (the record's ce_type, its predictions)."""
    consumer = AIOKafkaConsumer(PREDICTIONS.full_name(settings.topic_prefix), **kafka_client_kwargs(settings),
                                group_id=None, auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    records: list = []
    try:
        deadline = time.monotonic() + timeout_s
        while sum(len(p) for _, p in records) < total:
            assert time.monotonic() < deadline, f"{sum(len(p) for _, p in records)} of {total} predictions read"
            for part in (await consumer.getmany(timeout_ms=500)).values():
                for record in part:
                    event = CloudEvent.from_kafka(record.headers, record.value)
                    if event.type == "opml.inference.v1.PredictionBatch":
                        records.append((event.type, list(event.parse(inference_events.PredictionBatch).predictions)))
                    else:
                        records.append((event.type, [event.parse(inference_events.PredictionMade)]))
    finally:
        await consumer.stop()
    return records


def windows_by_count(records: list[tuple[str, list]], count: int) -> list[list[str]]:
    """The request ids of each window a stream of one-row records closes by count: a record belongs
    wholly to the window open when it comes, which closes once it holds ``count`` rows or more."""
    windows: list[list[str]] = []
    current: list[str] = []
    for _, predictions in records:
        current.extend(p.request_id for p in predictions)
        if len(current) >= count:
            windows.append(current)
            current = []
    return windows


def windows_by_time(records: list[tuple[str, list]], seconds: float) -> list[list[str]]:
    """The same by event time: a record whose first prediction is ``seconds`` past the window's first
    closes the window and opens the next (the last stays open)."""
    windows: list[list[str]] = []
    current: list[str] = []
    start = 0.0
    for _, predictions in records:
        first = predictions[0].time.ToNanoseconds() / 1e9
        if current and first >= start + seconds:
            windows.append(current)
            current = []
        if not current:
            start = first
        current.extend(p.request_id for p in predictions)
    return windows
