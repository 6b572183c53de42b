"""convert.py: every domain type survives the trip to its opml.traces.v1 message and back, and the
store's encoding in Redis is the bytes it always was."""

from __future__ import annotations

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from opml.traces.v1 import events_pb2
from opml.traces.v1 import traces_pb2 as pb

from opml_common.errors import InvalidArgument
from opml_trace_collector import convert, model
from opml_trace_collector.analysis import Bound, Breakdown, OpStat

T0 = 1_700_000_000.25  # exactly representable, so float seconds survive the nanosecond timestamps
RECORD = model.StepRecord(step=3, kind=model.StepKind.TRAIN, signature="keras.fit", start_ns=1_700_000_000_123_456_789,
                          duration_s=0.125, input_wait_s=0.01, examples=32)
SIGNATURE = model.SignatureStats(signature="keras.fit", kind=1, count=5, total_s=1.5, mean_s=0.3, min_s=0.1,
                                 max_s=0.5, input_wait_s=0.05, examples=160)
OPS = (OpStat(op_name="dense/MatMul", op_type="MatMul", category="computation", count=2, total_s=0.0012,
              mean_s=0.0006),)
BREAKDOWN = Breakdown(source="s3://b/traces/j/c/w.trace.json.gz", steps=2, step_time_s=0.001, step_time_p50_s=0.001,
                      step_time_p95_s=0.001, computation_s=6e-4, communication_s=1e-4, input_s=2.5e-4, idle_s=5e-5,
                      communication_total_s=2e-4, examples_per_second=12.5, bound=Bound.INPUT, worker="worker-0",
                      top_ops_by_total=OPS, top_ops_by_mean=OPS)

EVENTS = [
    model.TracerStarted(job="j", worker="w", session_id="s", tf_version="2.21.0", patched=("keras.Model.fit",),
                        pid=42, hostname="node-1", argv=("python", "train.py")),
    model.StepBatch(job="j", worker="w", session_id="s", sequence=7, steps=(RECORD, RECORD),
                    host=(model.HostSample(time_s=T0, cpu_percent=150.0, rss_bytes=1 << 30),)),
    model.TracerStopped(job="j", worker="w", session_id="s", steps=5, exit_code=1),
    model.TraceStored(job="j", worker="w", capture_id="c", trace_url="s3://b/traces/j/c/w.trace.json.gz",
                      first_step=1, steps=2, size_bytes=100, event_count=5),
    model.CaptureFailed(job="j", worker="w", capture_id="c", reason="oom"),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_tracer_events_round_trip(event: model.TracerEvent) -> None:
    message = convert.event_to_proto(event)
    assert type(message) is convert.EVENT_MESSAGES[type(event)]
    assert convert.event_from_proto(message) == event


def test_step_record_keeps_the_tracer_nanoseconds_and_the_series_bytes() -> None:
    start = Timestamp()
    start.FromNanoseconds(RECORD.start_ns)
    sent = events_pb2.StepRecord(step=3, kind=events_pb2.STEP_KIND_TRAIN, signature="keras.fit", start_time=start,
                                 duration_s=0.125, input_wait_s=0.01, examples=32)
    assert convert.step_record_from_proto(sent) == RECORD
    assert RECORD.start_us == start.ToMicroseconds()  # the series' score, as before
    # What the store keeps in a run's series: the same bytes as the tracer's message always gave.
    assert convert.encode_step(RECORD) == sent.SerializeToString(deterministic=True)
    assert convert.decode_step(sent.SerializeToString()) == RECORD


def test_jobs_runs_and_points_round_trip() -> None:
    job = model.Job(job="j", run_count=2, running_runs=1, steps=7, first_seen=T0, last_seen=T0 + 5,
                    mean_step_s=0.5, examples_per_second=64.0)
    assert convert.job_from_proto(convert.job_to_proto(job)) == job
    running = model.Run(job="j", worker="w", session_id="s", state=model.RunState.RUNNING, started=T0,
                        last_seen=T0 + 1, tf_version="2.21.0", patched=("keras.Model.fit",), pid=42, hostname="h",
                        argv=("python",), steps=5, batches=3, missing_batches=1, signatures=(SIGNATURE,),
                        examples_per_second=71.1, cpu_percent=150.0, rss_bytes=1 << 30)
    message = convert.run_to_proto(running)
    assert not message.HasField("stopped") and message.state == pb.RUN_STATE_RUNNING
    assert convert.run_from_proto(message) == running
    stopped = model.Run(job="j", worker="w", session_id="s", state=model.RunState.STOPPED, started=T0,
                        last_seen=T0 + 2, stopped=T0 + 2, exit_code=3)
    assert convert.run_to_proto(stopped).HasField("stopped")
    assert convert.run_from_proto(convert.run_to_proto(stopped)) == stopped
    point = model.StepPoint(worker="w", session_id="s", record=RECORD)
    assert convert.step_point_from_proto(convert.step_point_to_proto(point)) == point


def test_captures_round_trip_and_the_record_encoding() -> None:
    workers = (model.WorkerCapture(worker="w0", state=model.CaptureState.COMPLETED, trace_url="s3://b/t", first_step=1,
                                   steps=2, size_bytes=100, event_count=5),
               model.WorkerCapture(worker="w1", state=model.CaptureState.FAILED, reason="oom"))
    pending = model.Capture(capture_id="c", job="j", steps=2, state=model.CaptureState.PENDING, create_time=T0,
                            expire_time=T0 + 60, workers=workers, requested_by="token:admin")
    message = convert.capture_to_proto(pending)
    assert not message.HasField("end_time") and message.state == pb.CAPTURE_STATE_PENDING
    assert convert.capture_from_proto(message) == pending
    ended = model.Capture(capture_id="c", job="j", steps=2, state=model.CaptureState.FAILED, create_time=T0,
                          expire_time=T0 + 60, end_time=T0 + 3, workers=workers)
    assert convert.capture_from_proto(convert.capture_to_proto(ended)) == ended
    for worker in workers:
        stored = pb.WorkerCapture(**{f.name: getattr(worker, f.name) for f in pb.WorkerCapture.DESCRIPTOR.fields})
        assert convert.encode_worker_capture(worker) == stored.SerializeToString()
        assert convert.decode_worker_capture(stored.SerializeToString()) == worker


def test_breakdowns_and_summaries_round_trip_without_the_step_times() -> None:
    assert convert.breakdown_from_proto(convert.breakdown_to_proto(BREAKDOWN)) == BREAKDOWN
    assert convert.decode_breakdown(convert.encode_breakdown(BREAKDOWN)) == BREAKDOWN
    with_times = Breakdown(source="metrics", steps=2, step_time_s=0.5, bound=Bound.COMPUTE, step_times_s=(0.4, 0.6))
    assert convert.breakdown_to_proto(with_times).bound == pb.BOUND_COMPUTE
    assert convert.breakdown_from_proto(convert.breakdown_to_proto(with_times)).step_times_s == ()
    summary = model.Summary(job="j", metrics=Breakdown(source="metrics", steps=8, step_time_s=0.9375),
                            capture_id="c", traces=(BREAKDOWN,))
    assert convert.summary_from_proto(convert.summary_to_proto(summary)) == summary
    assert convert.summary_to_proto(model.Summary(job="j", metrics=summary.metrics)).capture_id == ""


def test_series_tokens_round_trip_and_are_tied_to_the_filters() -> None:
    query = '["j", "", "", 0]'
    token = convert.series_token((1_700_000_000_000_000, "s-a"), query)
    assert convert.series_cursor(token, query) == (1_700_000_000_000_000, "s-a")
    with pytest.raises(InvalidArgument, match="other filters") as other:
        convert.series_cursor(token, '["j", "w", "", 0]')
    assert other.value.field == "page_token"
    with pytest.raises(InvalidArgument, match="not a token"):
        convert.series_cursor("garbage!", query)
