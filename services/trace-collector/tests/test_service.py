"""The trace-collector end to end: a real process, real tansu, SeaweedFS and Redis; the tracer's
events published with the real EventPublisher, out of order and duplicated as at-least-once allows."""

from __future__ import annotations

import asyncio
import gzip
import json

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opml.traces.v1 import events_pb2
from opml.traces.v1 import traces_pb2 as pb

from opml_common.bus import CloudEvent
from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, Unauthenticated
from opml_devstack.testing.bus import headers_of, read_records
from opml_trace_collector_contract.client import TraceCollectorClient
from opml_trace_collector_contract.topics import TRACES, tracer_source

JOB = "mnist-cnn"
# A two-step trace: step 1 waits 0.25 ms for input, then computes (MatMul); step 2 ends in an allreduce.
TRACE_EVENTS = [
    {"ph": "X", "cat": "step", "name": "step 1", "ts": 0, "dur": 1000, "pid": 1, "tid": 1},
    {"ph": "X", "cat": "step", "name": "step 2", "ts": 1000, "dur": 1000, "pid": 1, "tid": 1},
    {"ph": "X", "cat": "op", "name": "it", "ts": 0, "dur": 500, "pid": 1, "tid": 2,
     "args": {"op_type": "IteratorGetNext", "op_name": "it"}},
    {"ph": "X", "cat": "op", "name": "dense/MatMul", "ts": 500, "dur": 1200, "pid": 1, "tid": 2,
     "args": {"op_type": "MatMul", "op_name": "dense/MatMul"}},
    {"ph": "X", "cat": "op", "name": "allreduce", "ts": 1700, "dur": 200, "pid": 1, "tid": 3,
     "args": {"op_type": "CollectiveReduceV2", "op_name": "allreduce"}}]


def _started(worker: str, session: str, job: str = JOB) -> events_pb2.TracerStarted:
    return events_pb2.TracerStarted(job=job, worker=worker, session_id=session, tf_version="2.21.0",
                                    patched=["keras.Model.fit"], pid=4242, hostname="node-1",
                                    argv=["python", "train.py"])


def _runs(client: TraceCollectorClient, job: str = JOB) -> dict[str, pb.Run]:
    try:
        return {r.session_id: r for r in client.list_runs(job)}
    except NotFound:
        return {}


def test_batches_late_duplicated_and_out_of_order_count_once(admin, reader, publish, batch, eventually,
                                                             scrape) -> None:
    a0 = batch(JOB, "worker-0", "s-a", 0, [(0, 0.10, 0.01), (1, 0.20, 0.01)])
    a1 = batch(JOB, "worker-0", "s-a", 1, [(2, 0.30, 0.01)])
    a2 = batch(JOB, "worker-0", "s-a", 2, [(3, 0.40, 0.01), (4, 0.50, 0.01)])
    b0 = batch(JOB, "worker-1", "s-b", 0, [(0, 1.0, 0.5)], examples=0, signature="tf.function:step")
    b2 = batch(JOB, "worker-1", "s-b", 2, [(2, 3.0, 0.5)], examples=0, signature="tf.function:step")
    # Sequence 2 before 0 and 1; sequence 2 again as a new event (a re-send); batch 1 twice as the
    # same event (a redelivery); worker-1's batch 1 never comes (still spooled).
    sent = publish(_started("worker-0", "s-a"), a2, a0, a2, _started("worker-1", "s-b"), b2, b0)
    publish(events=[sent[2]])
    publish(a1, a1)
    runs = eventually(lambda: (r := _runs(reader)) and r["s-a"].steps == 5 and r["s-b"].steps == 2 and r,
                      "both runs aggregated")
    a, b = runs["s-a"], runs["s-b"]
    assert (a.worker, a.state, a.tf_version, list(a.patched), a.pid, a.hostname) == (
        "worker-0", pb.RUN_STATE_RUNNING, "2.21.0", ["keras.Model.fit"], 4242, "node-1")
    assert (a.batches, a.missing_batches, b.batches, b.missing_batches) == (3, 0, 2, 1)
    [signature] = a.signatures
    assert (signature.signature, signature.count, signature.examples) == ("keras.fit", 5, 160)
    assert signature.total_s == pytest.approx(1.5) and signature.mean_s == pytest.approx(0.3)
    assert (signature.min_s, signature.max_s) == (pytest.approx(0.1), pytest.approx(0.5))
    assert a.examples_per_second == pytest.approx(64 / 0.9)  # of the newest batch (sequence 2)
    assert a.cpu_percent == 150.0 and a.rss_bytes == 1 << 30

    # The series: ordered by start time, then session, across runs and pages.
    points = reader.step_series(JOB, page_size=2)
    assert [(p.record.step, p.session_id) for p in points] == [
        (0, "s-a"), (0, "s-b"), (1, "s-a"), (2, "s-a"), (2, "s-b"), (3, "s-a"), (4, "s-a")]
    assert [p.record.duration_s for p in reader.step_series(JOB, worker="worker-1")] == [1.0, 3.0]
    since = Timestamp()
    since.FromMicroseconds(1_700_000_000_000_000 + 3_000_000)
    assert [p.record.step for p in reader.step_series(JOB, session_id="s-a", since=since, page_size=1)] == [3, 4]

    [job] = reader.list_jobs()
    assert (job.job, job.run_count, job.running_runs, job.steps) == (JOB, 2, 2, 7)
    assert job.mean_step_s == pytest.approx((1.5 + 4.0) / 7)

    # The run stops; a late batch of worker-1 closes its gap.
    publish(events_pb2.TracerStopped(job=JOB, worker="worker-0", session_id="s-a", steps=5, exit_code=0),
            batch(JOB, "worker-1", "s-b", 1, [(1, 2.0, 0.5)], examples=0, signature="tf.function:step"))
    runs = eventually(lambda: (r := _runs(reader)) and r["s-b"].steps == 3 and r["s-a"].state == pb.RUN_STATE_STOPPED
                      and r, "stop and late batch applied")
    assert runs["s-b"].missing_batches == 0 and runs["s-a"].HasField("stopped")

    summary = reader.summary(JOB)
    assert summary.metrics.steps == 8 and summary.metrics.step_time_s == pytest.approx(7.5 / 8)
    assert summary.capture_id == "" and not summary.traces

    text = scrape()
    assert f'opml_trace_collector_steps_total{{training_job="{JOB}",worker="worker-0"}} 5.0' in text
    assert f'opml_trace_collector_step_seconds_count{{training_job="{JOB}",worker="worker-1"}} 3.0' in text
    assert f'opml_trace_collector_examples_per_second{{training_job="{JOB}",worker="worker-0"}} 0.0' in text  # stopped
    assert 'opml_trace_collector_events_handled_total{outcome="duplicate",topic="opml.traces.v1",' \
           'type="opml.traces.v1.StepMetricsBatch"} 1.0' in text


def test_malformed_events_go_to_the_dead_letter_topic(admin, publish, platform_settings, bucket) -> None:
    garbage = CloudEvent.from_proto(events_pb2.StepMetricsBatch(), source=tracer_source("x", "y"), subject="x/y")
    garbage = CloudEvent(id=garbage.id, source=garbage.source, type=garbage.type, time=garbage.time,
                         data=b"\xff\xff not protobuf", subject="x/y")
    nameless = events_pb2.StepMetricsBatch(job="", worker="w", session_id="s", sequence=0)
    elsewhere = events_pb2.CaptureCompleted(job=JOB, worker="w", capture_id="c1",
                                            trace_url="s3://other-bucket/secrets.json.gz")
    publish(nameless, elsewhere, events=[garbage])
    records = asyncio.run(read_records(platform_settings, TRACES.dead_letter(platform_settings.topic_prefix), 3))
    errors = sorted(headers_of(r)["opml_error"].decode() for r in records)
    assert any("job: is required" in e for e in errors)
    assert any("trace_url must be under" in e and f"s3://{bucket}/traces/{JOB}/c1/" in e for e in errors)
    assert any("does not parse" in e for e in errors)
    assert admin.list_jobs() == []  # nothing of them was applied


def test_capture_arms_completes_serves_the_trace_and_summarizes(admin, reader, publish, batch, eventually, redis_db,
                                                                redis_prefix, put_trace) -> None:
    with pytest.raises(NotFound, match="no-such-job"):
        admin.capture("no-such-job", 5)
    publish(_started("worker-0", "s-1"), batch(JOB, "worker-0", "s-1", 0, [(0, 0.1, 0.0)]))
    eventually(lambda: _runs(admin), "the run")
    with pytest.raises(PermissionDenied, match="CaptureTrace needs the admin role"):
        reader.capture(JOB, 5)
    with pytest.raises(InvalidArgument) as bad:
        admin.capture(JOB, 0)
    assert bad.value.field == "steps"
    with pytest.raises(NotFound, match="worker-9"):
        admin.capture(JOB, 5, ["worker-9"])

    capture = admin.capture(JOB, 2)
    assert capture.state == pb.CAPTURE_STATE_PENDING and [w.worker for w in capture.workers] == ["worker-0"]
    assert capture.requested_by.startswith("token:")
    control = json.loads(redis_db.get(f"{redis_prefix}traces:capture:{JOB}"))
    assert control == {"capture_id": capture.capture_id, "steps": 2, "workers": []}
    assert 0 < redis_db.pttl(f"{redis_prefix}traces:capture:{JOB}") <= 4000
    with pytest.raises(FailedPrecondition, match="still pending"):
        admin.capture(JOB, 2)

    # The tracer's side: upload the whole trace, then announce it.
    completed = put_trace(JOB, "worker-0", capture.capture_id, TRACE_EVENTS)
    publish(completed, completed)
    done = eventually(lambda: (c := reader.get_capture(capture.capture_id)).state == pb.CAPTURE_STATE_COMPLETED
                      and c, "capture completed")
    assert done.HasField("end_time") and done.workers[0].size_bytes == completed.size_bytes
    assert redis_db.get(f"{redis_prefix}traces:capture:{JOB}") is None  # the tracers stop looking
    fetched = b"".join(reader.fetch_trace(capture.capture_id))
    assert len(fetched) == completed.size_bytes and json.loads(gzip.decompress(fetched))["traceEvents"] == TRACE_EVENTS
    assert [c.capture_id for c in reader.list_captures(JOB)] == [capture.capture_id]

    summary = reader.summary(JOB, top_k=2)
    assert summary.capture_id == capture.capture_id
    [breakdown] = summary.traces
    assert (breakdown.worker, breakdown.steps, breakdown.bound) == ("worker-0", 2, pb.BOUND_INPUT)
    assert breakdown.step_time_s == pytest.approx(0.001)
    assert breakdown.computation_s == pytest.approx(600e-6) and breakdown.input_s == pytest.approx(250e-6)
    assert breakdown.communication_s == pytest.approx(100e-6) and breakdown.idle_s == pytest.approx(50e-6)
    assert [op.op_name for op in breakdown.top_ops_by_total] == ["dense/MatMul", "it"]
    assert reader.summary(JOB, capture_id=capture.capture_id, top_k=2).traces[0] == breakdown  # cached

    # A second capture is allowed now; the tracer reports a failure.
    second = admin.capture(JOB, 1, ["worker-0"])
    publish(events_pb2.CaptureFailed(job=JOB, worker="worker-0", capture_id=second.capture_id,
                                     reason="profiler already running"))
    failed = eventually(lambda: (c := admin.get_capture(second.capture_id)).state == pb.CAPTURE_STATE_FAILED and c,
                        "capture failed")
    assert failed.workers[0].reason == "profiler already running"
    with pytest.raises(FailedPrecondition, match="no completed trace"):
        b"".join(reader.fetch_trace(second.capture_id))
    assert reader.summary(JOB).capture_id == capture.capture_id  # the latest capture with a trace


def test_a_silent_capture_expires_and_a_late_worker_is_not_complete(admin, publish, batch, eventually, redis_db,
                                                                    redis_prefix, scrape) -> None:
    publish(_started("worker-0", "s-1"), _started("worker-1", "s-2"),
            batch(JOB, "worker-0", "s-1", 0, [(0, 0.1, 0.0)]), batch(JOB, "worker-1", "s-2", 0, [(0, 0.1, 0.0)]))
    eventually(lambda: len(_runs(admin)) == 2, "two runs")
    capture = admin.capture(JOB, 3)
    assert [w.worker for w in capture.workers] == ["worker-0", "worker-1"]
    # worker-0 is killed mid-capture and announces nothing; worker-1 fails.
    publish(events_pb2.CaptureFailed(job=JOB, worker="worker-1", capture_id=capture.capture_id, reason="oom"))
    eventually(lambda: admin.get_capture(capture.capture_id).workers[1].state == pb.CAPTURE_STATE_FAILED,
               "worker-1's failure")
    # One worker's failure does not end the capture: it waits for worker-0 (and may have expired by now on a
    # loaded machine: the suite's capture timeout is 4 s), never FAILED as a whole.
    assert admin.get_capture(capture.capture_id).state in (pb.CAPTURE_STATE_PENDING, pb.CAPTURE_STATE_EXPIRED)
    expired = eventually(lambda: (c := admin.get_capture(capture.capture_id)).state == pb.CAPTURE_STATE_EXPIRED
                         and c, "expiry", timeout_s=15)
    assert [w.state for w in expired.workers] == [pb.CAPTURE_STATE_EXPIRED, pb.CAPTURE_STATE_FAILED]
    assert redis_db.get(f"{redis_prefix}traces:capture:{JOB}") is None
    assert admin.summary(JOB).capture_id == ""  # nothing half-written is reported
    assert admin.capture(JOB, 1).state == pb.CAPTURE_STATE_PENDING  # the job can be captured again
    text = scrape()
    assert 'opml_trace_collector_captures_total{outcome="expired"} 1.0' in text
    assert 'opml_trace_collector_captures_total{outcome="armed"} 2.0' in text


def test_global_tracing_switch_roles_and_health(collector, admin, reader, redis_db, redis_prefix) -> None:
    with grpc.insecure_channel(collector.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="opml.traces.v1.TraceCollectorService"))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with TraceCollectorClient(collector.target) as anonymous, pytest.raises(Unauthenticated):
        anonymous.list_jobs()
    assert reader.tracing() is True  # no flag: on
    assert admin.set_tracing(False) is False
    assert redis_db.get(f"{redis_prefix}traces:enabled") == b"0"
    with pytest.raises(PermissionDenied):
        reader.set_tracing(True)
    assert admin.set_tracing(True) is True and redis_db.get(f"{redis_prefix}traces:enabled") == b"1"


def test_bad_arguments_are_invalid_argument_naming_the_field(admin) -> None:
    calls = [
        (lambda: admin.list_runs("bad job"), "job"),
        (lambda: admin.stub.ListJobs(pb.ListJobsRequest(page_size=-1)), "page_size"),
        (lambda: admin.stub.GetStepSeries(pb.GetStepSeriesRequest(job="", page_size=1)), "job"),
        (lambda: admin.stub.GetCapture(pb.GetCaptureRequest()), "capture_id"),
        (lambda: admin.stub.GetSummary(pb.GetSummaryRequest(job="a/b")), "job"),
        (lambda: admin.stub.ListJobs(pb.ListJobsRequest(page_token="garbage")), "page_token"),
    ]
    for call, field in calls:
        with pytest.raises((InvalidArgument, grpc.RpcError)) as caught:
            call()
        error = caught.value
        if isinstance(error, grpc.RpcError):
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and field in error.details(), error.details()
        else:
            assert error.field == field


def _snapshot(client: TraceCollectorClient) -> dict[str, object] | None:
    """Everything the API tells about JOB (of captures, what the tracers' events carry); None while
    JOB is unknown."""
    if JOB not in [job.job for job in client.list_jobs()]:
        return None
    captures = []
    for capture in client.list_captures(JOB):
        # Who asked, when and for how long are facts of the request, which no event carries.
        capture.ClearField("create_time")
        capture.ClearField("expire_time")
        capture.ClearField("requested_by")
        captures.append(capture)
    return {"jobs": client.list_jobs(), "runs": client.list_runs(JOB), "series": client.step_series(JOB),
            "summary": client.summary(JOB), "captures": captures}


def _publish_a_history(admin, publish, batch, eventually, put_trace) -> dict[str, object]:
    """Two runs (one stopped, one with a gap), batches late and repeated, a completed capture; returns
    the API's snapshot once all of it is aggregated."""
    a = [batch(JOB, "worker-0", "s-a", n, [(2 * n, 0.1 * (n + 1), 0.01), (2 * n + 1, 0.2, 0.02)]) for n in range(3)]
    b = [batch(JOB, "worker-1", "s-b", n, [(n, 0.5, 0.3)], examples=0, signature="tf.function:step")
         for n in (0, 2)]
    publish(_started("worker-0", "s-a"), a[2], a[0], a[2], a[1], _started("worker-1", "s-b"), *b)
    eventually(lambda: (r := _runs(admin)) and r["s-a"].steps == 6 and r["s-b"].steps == 2, "the runs")
    capture = admin.capture(JOB, 2, ["worker-0"])
    publish(put_trace(JOB, "worker-0", capture.capture_id, TRACE_EVENTS),
            events_pb2.TracerStopped(job=JOB, worker="worker-0", session_id="s-a", steps=6, exit_code=0))
    eventually(lambda: admin.get_capture(capture.capture_id).state == pb.CAPTURE_STATE_COMPLETED
               and _runs(admin)["s-a"].state == pb.RUN_STATE_STOPPED, "the capture and the stop")
    return _snapshot(admin)


def test_state_lost_from_redis_is_rebuilt_from_the_topic_at_restart(collector, admin, publish, batch, eventually,
                                                                    put_trace, redis_db, redis_prefix,
                                                                    scrape) -> None:
    before = _publish_a_history(admin, publish, batch, eventually, put_trace)
    assert before["summary"].traces and before["runs"][1].missing_batches == 1  # s-b's batch 1 never came
    generation = redis_db.get(f"{redis_prefix}traces:generation")
    collector.stop()
    lost = list(redis_db.scan_iter(match=f"{redis_prefix}*"))
    assert len(lost) > 10
    redis_db.delete(*lost)

    collector.start()
    assert "opml_trace_collector_state_rebuilds_total 1.0" in scrape()
    assert redis_db.get(f"{redis_prefix}traces:generation") not in (None, generation)
    after = eventually(lambda: (s := _snapshot(admin)) == before and s, "the same state, rebuilt", timeout_s=30)
    assert after["jobs"][0].steps == 8


def test_state_lost_while_running_is_rebuilt_without_a_restart(collector, admin, publish, batch, eventually,
                                                               put_trace, redis_db, redis_prefix, scrape) -> None:
    before = _publish_a_history(admin, publish, batch, eventually, put_trace)
    assert "opml_trace_collector_state_rebuilds_total 1.0" in scrape()  # the first start built it
    redis_db.delete(*redis_db.scan_iter(match=f"{redis_prefix}*"))  # as a Redis flush or failover would
    eventually(lambda: _snapshot(admin) == before, "the same state, rebuilt", timeout_s=30)
    assert "opml_trace_collector_state_rebuilds_total 2.0" in scrape()
    # It carries on live under the new generation.
    publish(batch(JOB, "worker-1", "s-b", 1, [(1, 0.5, 0.3)], examples=0, signature="tf.function:step"))
    eventually(lambda: _runs(admin)["s-b"].missing_batches == 0, "a live batch after the rebuild")


def test_a_restart_with_the_state_kept_does_not_replay(collector, admin, publish, batch, eventually, redis_db,
                                                       redis_prefix, scrape) -> None:
    # Every event has the key JOB/worker-0, so all go to one partition, in this order.
    publish(_started("worker-0", "s-a"), *(batch(JOB, "worker-0", "s-a", n, [(n, 0.1, 0.0)]) for n in range(3)))
    eventually(lambda: (r := _runs(admin)) and r["s-a"].steps == 3, "the run")
    generation = redis_db.get(f"{redis_prefix}traces:generation")
    collector.stop()
    collector.start()
    assert "opml_trace_collector_state_rebuilds_total 0.0" in scrape()
    publish(batch(JOB, "worker-0", "s-a", 3, [(3, 0.1, 0.0)]))
    eventually(lambda: _runs(admin)["s-a"].steps == 4, "the new batch")
    # The new batch comes after the old events in its partition: had they been read again, they would
    # have been counted (applied, or skipped as duplicates) before it.
    text = scrape()
    assert 'opml_trace_collector_tracer_events_total{type="StepMetricsBatch"} 1.0' in text
    assert 'type="TracerStarted"' not in text and 'outcome="duplicate"' not in text
    assert redis_db.get(f"{redis_prefix}traces:generation") == generation


def test_summary_reads_a_bounded_sample_and_counts_every_step(collector_env, start_service, publish, batch,
                                                             eventually) -> None:
    small_sample = {"OPML_TRACE_COLLECTOR_SERIES_LENGTH": "40", "OPML_TRACE_COLLECTOR_SUMMARY_SAMPLE_STEPS": "20"}
    # Each run: 50 slow steps (1 s), then its 10 newest fast ones (0.1 s); 40 of the 60 are kept.
    batches = [batch(JOB, f"worker-{w}", f"s-{w}", n, [(30 * n + k, 1.0 if 30 * n + k < 50 else 0.1, 0.4)
                                                       for k in range(30)]) for w in range(2) for n in range(2)]
    small = start_service("trace-collector", env=collector_env, extra_env=small_sample)
    with TraceCollectorClient(small.target, token="reader-token") as client:
        publish(*batches)
        eventually(lambda: sum(r.steps for r in _runs(client).values()) == 120, "both runs")
        assert len(client.step_series(JOB)) == 80  # kept
        metrics = client.summary(JOB).metrics
    assert metrics.steps == 120 and metrics.step_time_s == pytest.approx((100 * 1.0 + 20 * 0.1) / 120)
    assert metrics.input_s == pytest.approx(0.4) and metrics.bound == pb.BOUND_INPUT
    assert metrics.examples_per_second == pytest.approx(120 * 32 / 102)
    # The percentiles come from the 10 newest steps of each run only: every kept step would give p95 = 1 s.
    assert (metrics.step_time_p50_s, metrics.step_time_p95_s) == (pytest.approx(0.1), pytest.approx(0.1))


def test_answers_to_an_armed_capture_whose_record_was_lost_rebuild_it(admin, publish, eventually, put_trace,
                                                                        redis_db, redis_prefix) -> None:
    # As after a Redis loss: the request's record is gone; the service's S3 mark says it armed the
    # capture, and the answers are what the record is rebuilt from.
    publish(_started("worker-0", "s-0"), _started("worker-1", "s-1"))
    eventually(lambda: len(_runs(admin)) == 2, "both runs")
    capture_id = admin.capture(JOB, 2).capture_id
    redis_db.delete(f"{redis_prefix}traces:capture-record:{capture_id}:info", f"{redis_prefix}traces:capture:{JOB}")
    completed = put_trace(JOB, "worker-0", capture_id, TRACE_EVENTS)
    publish(completed, events_pb2.CaptureFailed(job=JOB, worker="worker-1", capture_id=capture_id, reason="oom"),
            completed)

    def answered() -> pb.Capture | None:
        try:
            capture = admin.get_capture(capture_id)
        except NotFound:
            return None
        return capture if len(capture.workers) == 2 else None

    capture = eventually(answered, "both answers")
    assert (capture.job, capture.state, capture.requested_by) == (JOB, pb.CAPTURE_STATE_FAILED, "")
    assert [(w.worker, w.state) for w in capture.workers] == [("worker-0", pb.CAPTURE_STATE_COMPLETED),
                                                             ("worker-1", pb.CAPTURE_STATE_FAILED)]
    assert capture.HasField("end_time") and capture_id in [c.capture_id for c in admin.list_captures(JOB)]
