"""The consumer of opml.traces.v1: each tracer event becomes Redis state and Prometheus metrics.

Events come at least once, late and out of order. The EventConsumer skips event ids it has seen;
beyond that every effect is idempotent by itself: batches count once per (session, sequence)
(:meth:`TraceStore.apply_batch`), run facts are plain overwrites, capture answers are recorded
once per worker. An event whose data does not parse, that names no job, worker or session, or
whose step numbers are out of range (NaN, negative, an overflowing count) raises
:class:`MalformedEvent` and goes to the dead-letter topic.

An event is a hint. The consumer accepts only the tracers' sources
(``opml://trace-collector/tracer/<job>/<worker>``, :data:`topics.TRACER_SOURCE_PREFIX`); here the job
and worker the data names must be those of its source, else :class:`SourceMismatch` (dead-lettered,
nothing applied): a tracer cannot write another job's or worker's state under its own name. Capture
answers are applied only to captures this service armed (:class:`captures.UnknownCapture`).

The event's protobuf data is parsed here and converted once (:func:`convert.event_from_proto`): the
store and the capture manager see the domain events of :mod:`opml_trace_collector.model`.
"""

from __future__ import annotations

import logging
import time

from opml_common.bus import CloudEvent, MalformedEvent
from opml_common.errors import InvalidArgument
from opml_common.metrics import ServiceMetrics
from opml_trace_collector.captures import CaptureManager
from opml_trace_collector.convert import EVENT_MESSAGES, event_from_proto
from opml_trace_collector.model import CaptureFailed, StepBatch, TracerEvent, TracerStarted, TracerStopped, TraceStored
from opml_trace_collector.store import TraceStore, check_batch, check_name
from opml_trace_collector_contract.topics import tracer_source

log = logging.getLogger(__name__)

# Step-time buckets from 1 ms to 2 min: training steps, not RPC latencies.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class SourceMismatch(MalformedEvent):
    """An event's data names another job or worker than its ``ce_source``; never retriable."""


class Aggregator:
    """``handle`` is the EventConsumer handler.

    Metrics: ``opml_trace_collector_step_seconds{job,worker}`` (histogram of step times),
    ``opml_trace_collector_steps_total{job,worker}``, ``opml_trace_collector_examples_per_second{job,worker}``
    (of each worker's newest batch; sum by job in Grafana), ``opml_trace_collector_tracer_events_total{type}``.
    """

    def __init__(self, store: TraceStore, captures: CaptureManager, metrics: ServiceMetrics) -> None:
        self.store = store
        self.captures = captures
        # The traced job's label is training_job, not job: Prometheus owns `job` (the scrape job) and
        # would rename ours to exported_job.
        labels = ("training_job", "worker")
        self._step_seconds = metrics.histogram("step_seconds", "Step times of traced jobs, by job and worker.",
                                               labels, buckets=STEP_BUCKETS)
        self._steps = metrics.counter("steps_total", "Steps of traced jobs, by job and worker.", labels)
        self._throughput = metrics.gauge("examples_per_second",
                                         "Training throughput of each worker's newest batch, by job and worker.",
                                         labels)
        self._events = metrics.counter("tracer_events_total", "Tracer events applied, by type.", ("type",))
        handlers = {TracerStarted: self._started, StepBatch: self._batch, TracerStopped: self._stopped,
                    TraceStored: self.captures.on_completed, CaptureFailed: self.captures.on_failed}
        self._handlers = {message_cls.DESCRIPTOR.full_name: (message_cls, handlers[kind])
                          for kind, message_cls in EVENT_MESSAGES.items()}

    async def handle(self, event: CloudEvent) -> None:
        entry = self._handlers.get(event.type)
        if entry is None:
            raise MalformedEvent(f"event {event.id}: type {event.type!r} is not an opml.traces.v1 event")
        message_cls, handler = entry
        message = event_from_proto(event.parse(message_cls))
        _check_event(event, message)
        # The event's own time, not the time it is handled, so a replay rebuilds the same state;
        # a clock ahead of the service's counts as now.
        await handler(message, min(event.time.timestamp(), time.time()))
        self._events.labels(type=message_cls.DESCRIPTOR.name).inc()

    async def _started(self, message: TracerStarted, when: float) -> None:
        await self.store.record_started(message, when)
        log.info("run %s of %s/%s started (tf %s)", message.session_id, message.job, message.worker,
                 message.tf_version)

    async def _stopped(self, message: TracerStopped, when: float) -> None:
        await self.store.record_stopped(message, when)
        self._throughput.labels(training_job=message.job, worker=message.worker).set(0)

    async def _batch(self, batch: StepBatch, when: float) -> None:
        effect = await self.store.apply_batch(batch, when)
        if not effect.applied:
            return
        labels = {"training_job": batch.job, "worker": batch.worker}
        histogram = self._step_seconds.labels(**labels)
        for record in batch.steps:
            histogram.observe(record.duration_s)
        self._steps.labels(**labels).inc(effect.steps)
        if effect.newest and effect.examples_per_second > 0:
            self._throughput.labels(**labels).set(effect.examples_per_second)


def _check_event(event: CloudEvent, message: TracerEvent) -> None:
    """The names and numbers the store takes (a batch's: :func:`check_batch`), then the source."""
    try:
        check_name("job", message.job)
        check_name("worker", message.worker)
        session = getattr(message, "session_id", None)
        if session is not None:
            check_name("session_id", session)
        capture = getattr(message, "capture_id", None)
        if capture is not None:
            check_name("capture_id", capture)
        if isinstance(message, StepBatch):
            check_batch(message)
    except InvalidArgument as exc:
        raise MalformedEvent(f"event {event.id} ({event.type}): {exc.message}") from exc
    expected = tracer_source(message.job, message.worker)
    if event.source != expected:
        raise SourceMismatch(f"event {event.id} ({event.type}) names job {message.job!r} and worker "
                             f"{message.worker!r}, but its source is {event.source[:200]!r}, not {expected!r}; "
                             f"not applied")
