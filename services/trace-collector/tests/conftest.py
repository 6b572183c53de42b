"""Fixtures: a real trace-collector process on free ports, wired to the session's real infrastructure,
and a publisher of the tracer's events (the real EventPublisher, as the injected tracer uses it)."""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
import redis
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from opml.traces.v1 import events_pb2

from opml_common.bus import CloudEvent, EventPublisher
from opml_common.config import PlatformSettings
from opml_common.errors import NotFound
from opml_common.storage import s3_client
from opml_devstack.process import ServiceProcess
from opml_devstack.testing.bus import fresh_metrics
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_trace_collector_contract.client import TraceCollectorClient
from opml_trace_collector_contract.topics import TRACES, tracer_source

CAPTURE_TIMEOUT_S = 4.0
T0_US = 1_700_000_000_000_000  # start time of the synthetic steps


@pytest.fixture
def bucket(unique_prefix: str) -> str:
    return unique_prefix.rstrip("-")


@pytest.fixture
def collector_env(start_service: ServiceStarter, bucket: str) -> dict[str, str]:
    """The environment of a trace-collector process for this test (free ports, auth on)."""
    return start_service.env("trace-collector", extra_env={
        "OPML_TRACE_COLLECTOR_BUCKET": bucket,
        "OPML_TRACE_COLLECTOR_CAPTURE_TIMEOUT_S": str(CAPTURE_TIMEOUT_S),
        "OPML_TRACE_COLLECTOR_STATE_CHECK_INTERVAL_S": "0.5",
    })


@pytest.fixture
def collector(start_service: ServiceStarter, collector_env: dict[str, str]) -> ServiceProcess:
    """A running trace-collector with auth on (the plugin's ``tokens``), stopped after the test."""
    return start_service("trace-collector", env=collector_env)


@pytest.fixture
def admin(collector: ServiceProcess) -> Iterator[TraceCollectorClient]:
    with TraceCollectorClient(collector.target, token=TOKENS["admin"]) as client:
        yield client


@pytest.fixture
def reader(collector: ServiceProcess) -> Iterator[TraceCollectorClient]:
    with TraceCollectorClient(collector.target, token=TOKENS["reader"]) as client:
        yield client


@pytest.fixture
def redis_db(settings_env: dict[str, str]) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(settings_env["OPML_REDIS_URL"])
    yield client
    client.close()


@pytest.fixture
def redis_prefix(settings_env: dict[str, str]) -> str:
    return settings_env["OPML_REDIS_PREFIX"]


@pytest.fixture
def publish(platform_settings: PlatformSettings) -> Callable[..., list[CloudEvent]]:
    """``publish(*messages, events=None, source=None)``: publish tracer messages (or ready CloudEvents) to
    TRACES, keyed ``job/worker`` and from the source ``opml://trace-collector/tracer/<job>/<worker>`` as the
    tracer does (``source`` overrides it, for forgeries); returns the events."""

    def run(*messages: Message, events: list[CloudEvent] | None = None, source: str | None = None) -> list[CloudEvent]:
        async def send() -> list[CloudEvent]:
            sent = []
            async with EventPublisher(platform_settings, source="opml/tracer-test",
                                      metrics=fresh_metrics("tracer-test")[0]) as publisher:
                for message in messages:
                    subject = f"{message.job}/{message.worker}"
                    event = CloudEvent.from_proto(message, subject=subject,
                                                  source=source or tracer_source(message.job, message.worker))
                    await publisher.publish(TRACES, event)
                    sent.append(event)
                for event in events or ():
                    await publisher.publish(TRACES, event)
            return sent

        return asyncio.run(send())

    return run


@pytest.fixture
def batch() -> Callable[..., events_pb2.StepMetricsBatch]:
    """``batch(job, worker, session, sequence, steps=[(step, duration_s, input_wait_s)], ...)``: a
    StepMetricsBatch of training steps one second apart (step n starts at T0 + n s)."""

    def make(job: str, worker: str, session: str, sequence: int, steps: list[tuple[int, float, float]],
             *, examples: int = 32, signature: str = "keras.fit") -> events_pb2.StepMetricsBatch:
        records = []
        for step, duration, wait in steps:
            start = Timestamp()
            start.FromMicroseconds(T0_US + step * 1_000_000)
            records.append(events_pb2.StepRecord(step=step, kind=events_pb2.STEP_KIND_TRAIN, signature=signature,
                                                 start_time=start, duration_s=duration, input_wait_s=wait,
                                                 examples=examples))
        return events_pb2.StepMetricsBatch(job=job, worker=worker, session_id=session, sequence=sequence,
                                           steps=records, host=[events_pb2.HostSample(cpu_percent=150.0,
                                                                                      rss_bytes=1 << 30)])

    return make


@pytest.fixture
def eventually() -> Callable[..., object]:
    """``eventually(fn, what, timeout_s=20)``: poll ``fn`` until it returns a truthy value; return it."""

    def wait(fn: Callable[[], object], what: str, timeout_s: float = 20.0) -> object:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                result = fn()
            except (AssertionError, KeyError, NotFound):  # not there yet: a run or job still to arrive
                result = None
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
            time.sleep(0.05)

    return wait


@pytest.fixture
def scrape(collector: ServiceProcess) -> Callable[[], str]:
    """``scrape()``: the collector's Prometheus /metrics text now."""

    def read() -> str:
        port = collector.env["OPML_TRACE_COLLECTOR_METRICS_PORT"]
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()

    return read


@pytest.fixture
def put_trace(platform_settings: PlatformSettings, bucket: str) -> Callable[..., events_pb2.CaptureCompleted]:
    """``put_trace(job, worker, capture_id, trace_events, first_step=1, steps=2)``: do the tracer's side of a
    capture (upload the gzipped Chrome trace where the tracer puts it) and return its CaptureCompleted."""

    def put(job: str, worker: str, capture_id: str, trace_events: list[dict], *, first_step: int = 1,
            steps: int = 2) -> events_pb2.CaptureCompleted:
        trace = {"traceEvents": trace_events, "displayTimeUnit": "ms",
                 "metadata": {"job": job, "worker": worker, "capture_id": capture_id, "first_step": first_step,
                              "steps": steps, "tf_version": "2.21.0"}}
        data = gzip.compress(json.dumps(trace).encode())
        key = f"traces/{job}/{capture_id}/{worker}.trace.json.gz"
        s3_client(platform_settings).put_object(bucket, key, io.BytesIO(data), len(data),
                                                content_type="application/gzip")
        return events_pb2.CaptureCompleted(job=job, worker=worker, capture_id=capture_id, first_step=first_step,
                                           steps=steps, trace_url=f"s3://{bucket}/{key}", size_bytes=len(data),
                                           event_count=len(trace_events))

    return put
