"""Fixtures: a real bundle-store holding a reference bundle, a real monitoring-scorer, and a producer of
predictions published to the real broker as the inference-router publishes them (each built by the
router's contract, ``prediction_made``, under its event source and subject): PredictionMade records of
requests, or PredictionBatch records of one-row requests of one version, and of LabelObserved events."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
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
from opml_devstack.testing.services import TOKENS, ServiceStarter, env_prefix
from opml_inference_router_contract.names import EVENT_SOURCE as ROUTER_SOURCE
from opml_inference_router_contract.predictions import RECORD_CAP_BYTES, prediction_made, prediction_subject
from opml_monitoring_scorer.__main__ import SPEC
from opml_monitoring_scorer.core.reference import Task
from opml_monitoring_scorer.core.scorer import dump_reference
from opml_monitoring_scorer.synthetic import FEATURES, Rows, SyntheticWorld
from opml_monitoring_scorer.topics import LABELS, PREDICTIONS
from opml_monitoring_scorer_contract.client import MonitoringClient
from opml_monitoring_scorer_contract.names import LABEL_SOURCE

SRC = str(Path(__file__).resolve().parents[1] / "src")
WINDOW = 200
BATCH = 10
QA_SOURCE = "plant-3/qa"
"""A label producer the model's monitoring.yaml names (besides the platform's label tools)."""
CONFIG = f"""
features: {{x: [{", ".join(FEATURES)}]}}
outputs: {{scores: probabilities}}
window: {{count: {WINDOW}}}
rules:
  - {{name: drift, signal: drift, over: 0.25, for: 2, clear_after: 2, margin: 0.05}}
  - {{name: accuracy, signal: mpp, under: 0.7, for: 2}}
labels: {{producers: [{QA_SOURCE}]}}
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
    """Publishes predictions as the router does (``send``: requests of BATCH rows, one PredictionMade
    record each; ``queue``: one-row requests, up to ``batch_max`` of them a record, as the router
    publishes what is queued for a version), and labels. ``record_cap_bytes``: the router's record cap
    (0: every prediction carries summaries only, as large tensors do). ``source``: whose predictions they
    claim to be (default the router's)."""

    def __init__(self, settings: PlatformSettings, model: str = "fraud", version: str = "1", *,
                 batch_max: int = 100, ids: str = "req", record_cap_bytes: int = RECORD_CAP_BYTES,
                 source: str = ROUTER_SOURCE) -> None:
        self.settings = settings
        self.model, self.version, self.ids = model, version, ids
        self.batch_max, self.record_cap_bytes = batch_max, record_cap_bytes
        self.publisher = EventPublisher(settings, source=source, metrics=ServiceMetrics("test", CollectorRegistry()))
        self.sent = 0
        self.labels: dict[str, list[float]] = {}

    async def __aenter__(self) -> Producer:
        await self.publisher.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.publisher.stop()

    def prediction(self, request_id: str, inputs: dict[str, np.ndarray], scores: np.ndarray, *,
                   received: float | None = None, into: inference_events.PredictionMade | None = None,
                   ) -> inference_events.PredictionMade:
        """The PredictionMade of one request of this producer's version, as the router makes it."""
        request = encode_request(self.model, inputs, version=self.version, request_id=request_id)
        response = encode_outputs(pb.ModelInferResponse(model_name=self.model, model_version=self.version,
                                                        id=request_id), {"probabilities": scores})
        return prediction_made(request_id=request_id, model=self.model, version=self.version,
                               request=request.SerializeToString(), response=response.SerializeToString(),
                               received=time.time() if received is None else received, latency_s=0.001,
                               replica="127.0.0.1:1", record_cap_bytes=self.record_cap_bytes, into=into)

    async def publish(self, record: inference_events.PredictionMade | inference_events.PredictionBatch) -> None:
        """One record under this producer's source and the router's subject (acknowledged by the broker)."""
        await self.publisher.publish_proto(PREDICTIONS, record, subject=prediction_subject(self.model, self.version))

    async def queue(self, rows: Rows, *, times: np.ndarray | None = None, chunk: int | None = None) -> None:
        """One-row requests (``times``: when each was received; default now) published ``chunk`` at a
        time (default all at once) in records of up to ``batch_max`` in the order served: a
        PredictionBatch, or a PredictionMade when one is left."""
        n = len(rows.outputs)
        x = np.column_stack([rows.features[f] for f in FEATURES]).astype(np.float32)
        color = rows.features["color"].astype(object)
        scores = rows.outputs.class_scores().astype(np.float32)
        chunk = chunk or n
        for begin in range(0, n, chunk):
            end = min(begin + chunk, n)
            for first in range(begin, end, self.batch_max):
                batch = inference_events.PredictionBatch()
                for i in range(first, min(first + self.batch_max, end)):
                    request_id = f"{self.ids}-{self.sent}"
                    self.prediction(request_id, {"x": x[i:i + 1], "color": np.array([[color[i].encode()]],
                                                                                    dtype=object)},
                                    scores[i:i + 1], received=None if times is None else float(times[i]),
                                    into=batch.predictions.add())
                    self.labels[request_id] = [float(rows.labels[i])]
                    self.sent += 1
                await self.publish(batch if len(batch.predictions) > 1 else batch.predictions[0])

    async def send(self, rows: Rows, *, start: int = 0) -> None:
        n = len(rows.outputs)
        x = np.column_stack([rows.features[f] for f in FEATURES]).astype(np.float32)
        color = rows.features["color"].astype(object)
        scores = rows.outputs.class_scores().astype(np.float32)
        for i in range(0, n, BATCH):
            request_id = f"{self.ids}-{self.sent}"
            await self.publish(self.prediction(
                request_id, {"x": x[i:i + BATCH],
                             "color": np.array([[c.encode()] for c in color[i:i + BATCH]], dtype=object)},
                scores[i:i + BATCH]))
            self.labels[request_id] = [float(v) for v in rows.labels[i:i + BATCH]]
            self.sent += 1

    async def send_labels(self, request_ids: list[str], *, source: str = LABEL_SOURCE) -> None:
        """The true labels of these requests, from ``source`` (default: the platform's label tools)."""
        for request_id in request_ids:
            await self.send_label(request_id, self.labels[request_id], source=source)

    async def send_label(self, request_id: str, values: list[float], *, source: str = LABEL_SOURCE,
                         at: datetime | None = None) -> None:
        """One LabelObserved from ``source``, its event time ``at`` (default: now)."""
        label = label_events_pb2.LabelObserved(request_id=request_id, values=values)
        event = CloudEvent.from_proto(label, source=source, subject=request_id)
        if at is not None:
            event = dataclasses.replace(event, time=at)
        await self.publisher.publish(LABELS, event, key=request_id)


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
