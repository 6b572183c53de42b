"""Conversions between the domain types (:mod:`opml_trace_collector.model`, :mod:`analysis`) and the
opml.traces.v1 messages: the API's (traces.proto) and the tracer's events (events.proto). No logic here.

Used at the edges: the servicer (replies), the aggregator (an event's data, once parsed), the CLI
(the client's replies); and by the store as its storage encoding of step records, capture answers
and cached breakdowns (protobuf bytes in Redis, unchanged from before the domain types).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
from typing import Any, TypeVar

from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from opml.traces.v1 import events_pb2
from opml.traces.v1 import traces_pb2 as pb

from opml_common.errors import InvalidArgument
from opml_trace_collector import model
from opml_trace_collector.analysis import Bound, Breakdown, OpStat

D = TypeVar("D")


def timestamp(seconds: float) -> Timestamp:
    """The Timestamp of epoch ``seconds`` (whole seconds and nanoseconds apart, so no precision is lost)."""
    whole = math.floor(seconds)
    return Timestamp(seconds=whole, nanos=min(999_999_999, round((seconds - whole) * 1e9)))


def seconds(stamp: Timestamp) -> float:
    return stamp.seconds + stamp.nanos / 1e9


def _maybe_timestamp(value: float | None) -> Timestamp | None:
    return None if value is None else timestamp(value)  # None leaves the message field unset


def _maybe_seconds(message: Message, field: str) -> float | None:
    return seconds(getattr(message, field)) if message.HasField(field) else None


def _flat(cls: type[D], message: Message, **overrides: Any) -> D:
    """A dataclass from the message's fields of the same names (``overrides`` for the others)."""
    return cls(**{f.name: getattr(message, f.name) for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                  if f.name not in overrides}, **overrides)


def _values(item: object, *skip: str) -> dict[str, Any]:
    """A dataclass's fields (shallow), less ``skip``, for a message of the same field names."""
    return {f.name: getattr(item, f.name) for f in dataclasses.fields(item)  # type: ignore[arg-type]
            if f.name not in skip}


# ---------------------------------------------------------------- the tracer's events

def step_record_to_proto(record: model.StepRecord) -> events_pb2.StepRecord:
    start = Timestamp()
    start.FromNanoseconds(record.start_ns)
    return events_pb2.StepRecord(start_time=start, **_values(record, "start_ns"))


def step_record_from_proto(message: events_pb2.StepRecord) -> model.StepRecord:
    return _flat(model.StepRecord, message, start_ns=message.start_time.ToNanoseconds())


def _host_to_proto(sample: model.HostSample) -> events_pb2.HostSample:
    return events_pb2.HostSample(time=timestamp(sample.time_s), cpu_percent=sample.cpu_percent,
                                 rss_bytes=sample.rss_bytes)


def _host_from_proto(message: events_pb2.HostSample) -> model.HostSample:
    return model.HostSample(time_s=seconds(message.time), cpu_percent=message.cpu_percent,
                            rss_bytes=message.rss_bytes)


EVENT_MESSAGES: dict[type, type[Message]] = {
    model.TracerStarted: events_pb2.TracerStarted, model.StepBatch: events_pb2.StepMetricsBatch,
    model.TracerStopped: events_pb2.TracerStopped, model.TraceStored: events_pb2.CaptureCompleted,
    model.CaptureFailed: events_pb2.CaptureFailed,
}
"""The events.proto message of each tracer event."""
_EVENT_TYPES = {message: kind for kind, message in EVENT_MESSAGES.items()}


def event_from_proto(message: Message) -> model.TracerEvent:
    """The domain event of a tracer event's data (one of :data:`EVENT_MESSAGES`' messages)."""
    kind = _EVENT_TYPES[type(message)]
    if kind is model.StepBatch:
        return _flat(model.StepBatch, message, steps=tuple(step_record_from_proto(r) for r in message.steps),
                     host=tuple(_host_from_proto(h) for h in message.host))
    if kind is model.TracerStarted:
        return _flat(model.TracerStarted, message, patched=tuple(message.patched), argv=tuple(message.argv))
    return _flat(kind, message)


def event_to_proto(event: model.TracerEvent) -> Message:
    """The events.proto message of a domain event (what the tracer publishes)."""
    message_cls = EVENT_MESSAGES[type(event)]
    if isinstance(event, model.StepBatch):
        return message_cls(steps=[step_record_to_proto(r) for r in event.steps],
                           host=[_host_to_proto(h) for h in event.host], **_values(event, "steps", "host"))
    return message_cls(**_values(event))


# ---------------------------------------------------------------- jobs, runs, series

def job_to_proto(job: model.Job) -> pb.Job:
    return pb.Job(first_seen=timestamp(job.first_seen), last_seen=timestamp(job.last_seen),
                  **_values(job, "first_seen", "last_seen"))


def job_from_proto(message: pb.Job) -> model.Job:
    return _flat(model.Job, message, first_seen=seconds(message.first_seen), last_seen=seconds(message.last_seen))


def signature_to_proto(stats: model.SignatureStats) -> pb.SignatureStats:
    return pb.SignatureStats(**_values(stats))


def signature_from_proto(message: pb.SignatureStats) -> model.SignatureStats:
    return _flat(model.SignatureStats, message)


def run_to_proto(run: model.Run) -> pb.Run:
    return pb.Run(started=timestamp(run.started), last_seen=timestamp(run.last_seen),
                  stopped=_maybe_timestamp(run.stopped), signatures=[signature_to_proto(s) for s in run.signatures],
                  **_values(run, "started", "last_seen", "stopped", "signatures"))


def run_from_proto(message: pb.Run) -> model.Run:
    return _flat(model.Run, message, state=model.RunState(message.state), started=seconds(message.started),
                 last_seen=seconds(message.last_seen),
                 stopped=_maybe_seconds(message, "stopped"),
                 patched=tuple(message.patched), argv=tuple(message.argv),
                 signatures=tuple(signature_from_proto(s) for s in message.signatures))


def step_point_to_proto(point: model.StepPoint) -> pb.StepPoint:
    return pb.StepPoint(worker=point.worker, session_id=point.session_id, record=step_record_to_proto(point.record))


def step_point_from_proto(message: pb.StepPoint) -> model.StepPoint:
    return model.StepPoint(worker=message.worker, session_id=message.session_id,
                           record=step_record_from_proto(message.record))


def _fingerprint(query: str) -> str:
    return hashlib.sha256(query.encode()).hexdigest()[:8]


def series_token(cursor: tuple[int, str], query: str) -> str:
    """GetStepSeries' page token of a cursor of :meth:`TraceStore.series` (tied to the request's filters)."""
    return base64.urlsafe_b64encode(json.dumps([cursor[0], cursor[1], _fingerprint(query)]).encode()).decode()


def series_cursor(token: str, query: str) -> tuple[int, str]:
    """The cursor of a page token of :func:`series_token`.

    Raises:
        InvalidArgument: ``page_token`` is not one this service issued, or was issued for other filters.
    """
    try:
        start_us, session, fingerprint = json.loads(base64.urlsafe_b64decode(token.encode()))
        cursor = (int(start_us), str(session))
    except (ValueError, TypeError):
        raise InvalidArgument("page_token", f"is not a token this service issued: {token!r}") from None
    if fingerprint != _fingerprint(query):
        raise InvalidArgument("page_token", "was issued for a request with other filters; start from the first page")
    return cursor


# ---------------------------------------------------------------- captures

def worker_capture_to_proto(worker: model.WorkerCapture) -> pb.WorkerCapture:
    return pb.WorkerCapture(**_values(worker))


def worker_capture_from_proto(message: pb.WorkerCapture) -> model.WorkerCapture:
    return _flat(model.WorkerCapture, message, state=model.CaptureState(message.state))


def capture_to_proto(capture: model.Capture) -> pb.Capture:
    return pb.Capture(create_time=timestamp(capture.create_time), expire_time=timestamp(capture.expire_time),
                      end_time=_maybe_timestamp(capture.end_time),
                      workers=[worker_capture_to_proto(w) for w in capture.workers],
                      **_values(capture, "create_time", "expire_time", "end_time", "workers"))


def capture_from_proto(message: pb.Capture) -> model.Capture:
    return _flat(model.Capture, message, state=model.CaptureState(message.state),
                 create_time=seconds(message.create_time), expire_time=seconds(message.expire_time),
                 end_time=_maybe_seconds(message, "end_time"),
                 workers=tuple(worker_capture_from_proto(w) for w in message.workers))


# ---------------------------------------------------------------- analytics

def _op_to_proto(stat: OpStat) -> pb.OpStat:
    return pb.OpStat(**_values(stat))


def breakdown_to_proto(breakdown: Breakdown) -> pb.Breakdown:
    """The message of a breakdown (its ``step_times_s`` are not part of the API)."""
    return pb.Breakdown(bound=int(breakdown.bound), top_ops_by_total=[_op_to_proto(s) for s in breakdown.top_ops_by_total],
                        top_ops_by_mean=[_op_to_proto(s) for s in breakdown.top_ops_by_mean],
                        **_values(breakdown, "bound", "step_times_s", "top_ops_by_total", "top_ops_by_mean"))


def breakdown_from_proto(message: pb.Breakdown) -> Breakdown:
    return _flat(Breakdown, message, bound=Bound(message.bound), step_times_s=(),
                 top_ops_by_total=tuple(_flat(OpStat, s) for s in message.top_ops_by_total),
                 top_ops_by_mean=tuple(_flat(OpStat, s) for s in message.top_ops_by_mean))


def summary_to_proto(summary: model.Summary) -> pb.Summary:
    return pb.Summary(job=summary.job, metrics=breakdown_to_proto(summary.metrics), capture_id=summary.capture_id,
                      traces=[breakdown_to_proto(b) for b in summary.traces])


def summary_from_proto(message: pb.Summary) -> model.Summary:
    return model.Summary(job=message.job, metrics=breakdown_from_proto(message.metrics),
                         capture_id=message.capture_id, traces=tuple(breakdown_from_proto(b) for b in message.traces))


# ---------------------------------------------------------------- the store's encoding in Redis
# The bytes of these messages are what the service has always kept in Redis (a run's series, a capture
# record's answers, the cached breakdowns of traces): keep them readable by a running collector.

def encode_step(record: model.StepRecord) -> bytes:
    return step_record_to_proto(record).SerializeToString(deterministic=True)


def decode_step(data: bytes) -> model.StepRecord:
    return step_record_from_proto(events_pb2.StepRecord.FromString(data))


def encode_worker_capture(worker: model.WorkerCapture) -> bytes:
    return worker_capture_to_proto(worker).SerializeToString()


def decode_worker_capture(data: bytes) -> model.WorkerCapture:
    return worker_capture_from_proto(pb.WorkerCapture.FromString(data))


def encode_breakdown(breakdown: Breakdown) -> bytes:
    return breakdown_to_proto(breakdown).SerializeToString()


def decode_breakdown(data: bytes) -> Breakdown:
    return breakdown_from_proto(pb.Breakdown.FromString(data))
