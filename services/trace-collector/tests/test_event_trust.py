"""Tracer events are hints: forged ones are dead-lettered and change nothing. A real trace-collector
process, real tansu, SeaweedFS and Redis; the forgeries are published as any writer of the topic can."""

from __future__ import annotations

import asyncio

import pytest
from opml.traces.v1 import events_pb2
from opml.traces.v1 import traces_pb2 as pb

from opml_devstack.testing.bus import headers_of, read_records
from opml_trace_collector_contract.topics import TRACES, tracer_source

JOB = "mnist-cnn"
TRACE_EVENTS = [{"ph": "X", "cat": "step", "name": "step 1", "ts": 0, "dur": 1000, "pid": 1, "tid": 1}]


@pytest.fixture
def collector_env(collector_env: dict[str, str]) -> dict[str, str]:
    """The collector with captures that outlive the test: a forged answer must leave the capture PENDING,
    and the suite's 4 s timeout could expire it first on a loaded machine (EXPIRED, not the forgery's doing)."""
    return {**collector_env, "OPML_TRACE_COLLECTOR_CAPTURE_TIMEOUT_S": "600"}


def _started(worker: str, session: str, job: str = JOB) -> events_pb2.TracerStarted:
    return events_pb2.TracerStarted(job=job, worker=worker, session_id=session, tf_version="2.21.0")


def _dead_letters(platform_settings, count: int) -> list[dict[str, bytes]]:
    """The first ``count`` records of the dead-letter topic (waits until they are there), in offset order."""
    records = asyncio.run(read_records(platform_settings, TRACES.dead_letter(platform_settings.topic_prefix), count))
    return [headers_of(r) for r in sorted(records, key=lambda r: (r.partition, r.offset))]


def test_events_from_a_foreign_source_are_dead_lettered_and_change_nothing(admin, publish, batch, put_trace,
                                                                           eventually, scrape,
                                                                           platform_settings) -> None:
    publish(_started("worker-0", "s-a"), batch(JOB, "worker-0", "s-a", 0, [(0, 0.1, 0.0)]))
    eventually(lambda: [r.steps for r in admin.list_runs(JOB)] == [1], "the genuine run")
    capture = admin.capture(JOB, 1)
    # A writer of the topic poses as a tracer with a look-alike source: a batch, the armed capture's
    # answer and the run's end, all keyed as worker-0's events (one partition, in this order).
    forged_source = f"opml://evil/tracer/{JOB}/worker-0"
    forged = publish(batch(JOB, "worker-0", "s-a", 1, [(1, 99.0, 0.0)]),
                     put_trace(JOB, "worker-0", capture.capture_id, TRACE_EVENTS),
                     events_pb2.TracerStopped(job=JOB, worker="worker-0", session_id="s-a", steps=9, exit_code=0),
                     source=forged_source)
    publish(batch(JOB, "worker-0", "s-a", 2, [(2, 0.2, 0.0)]))  # genuine, after the forgeries
    eventually(lambda: [r.steps for r in admin.list_runs(JOB)] == [2], "the genuine batch after the forgeries")

    [run] = admin.list_runs(JOB)
    assert (run.state, run.missing_batches) == (pb.RUN_STATE_RUNNING, 1)  # sequence 1 counts as never come
    assert admin.get_capture(capture.capture_id).state == pb.CAPTURE_STATE_PENDING
    dead = _dead_letters(platform_settings, 3)
    assert [d["ce_id"] for d in dead] == [e.id.encode() for e in forged]
    for headers in dead:
        assert headers["opml_error_type"] == b"UntrustedSource"
        assert f"ce_source '{forged_source}' is not a source".encode() in headers["opml_error"]
        assert b"accepted: opml://trace-collector/tracer/*" in headers["opml_error"]
    assert 'opml_trace_collector_events_untrusted_total{topic="opml.traces.v1"} 3.0' in scrape()


def test_an_event_naming_another_job_or_worker_than_its_source_is_dead_lettered(admin, publish, batch, put_trace,
                                                                                eventually, platform_settings) -> None:
    publish(_started("worker-0", "s-a"), _started("worker-1", "s-b"))
    eventually(lambda: len(admin.list_runs(JOB)) == 2, "both runs")
    capture = admin.capture(JOB, 1)
    as_worker_0 = tracer_source(JOB, "worker-0")
    # worker-0's tracer claims to be job B, and answers the capture in worker-1's name.
    forged = publish(_started("worker-0", "s-x", job="job-b"), batch("job-b", "worker-0", "s-x", 0, [(0, 1.0, 0.0)]),
                     put_trace(JOB, "worker-1", capture.capture_id, TRACE_EVENTS), source=as_worker_0)
    dead = _dead_letters(platform_settings, 3)

    assert sorted(d["ce_id"] for d in dead) == sorted(e.id.encode() for e in forged)
    for headers in dead:
        assert headers["opml_error_type"] == b"SourceMismatch"
        assert f"but its source is '{as_worker_0}'".encode() in headers["opml_error"]
    assert any(b"names job 'job-b' and worker 'worker-0'" in d["opml_error"] for d in dead)
    assert any(f"names job '{JOB}' and worker 'worker-1'".encode() in d["opml_error"] for d in dead)
    assert [job.job for job in admin.list_jobs()] == [JOB]  # no job B
    workers = {w.worker: w.state for w in admin.get_capture(capture.capture_id).workers}
    assert workers == {"worker-0": pb.CAPTURE_STATE_PENDING, "worker-1": pb.CAPTURE_STATE_PENDING}


def test_answers_to_a_capture_the_collector_never_armed_are_dead_lettered(admin, publish, put_trace, eventually,
                                                                          platform_settings) -> None:
    publish(_started("worker-0", "s-a"))
    eventually(lambda: admin.list_runs(JOB), "the run")
    # The tracer's own source and job, but a capture nobody requested: no Redis record, no S3 mark.
    made_up = publish(put_trace(JOB, "worker-0", "c-made-up", TRACE_EVENTS),
                      events_pb2.CaptureFailed(job=JOB, worker="worker-0", capture_id="c-made-up2", reason="x"))
    dead = _dead_letters(platform_settings, 2)

    assert sorted(d["ce_id"] for d in dead) == sorted(e.id.encode() for e in made_up)
    assert {d["opml_error_type"] for d in dead} == {b"UnknownCapture"}
    assert any(b"capture 'c-made-up' of job 'mnist-cnn' was not armed by this trace-collector" in d["opml_error"]
               for d in dead)
    assert admin.list_captures(JOB) == []
