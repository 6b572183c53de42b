"""The job-orchestrator service end to end: a real process, real tansu and Redis, real job processes."""

from __future__ import annotations

import asyncio
import os
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opml.jobs.v1 import events_pb2, jobs_pb2_grpc
from opml.jobs.v1 import jobs_pb2 as pb

from opml_common.bus import CloudEvent
from opml_common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from opml_common.grpc.client import open_channel
from opml_common.grpc.status import field_violations
from opml_devstack.testing.bus import read_records
from opml_job_orchestrator_contract.client import JobClient
from opml_job_orchestrator_contract.topics import JOBS


def _events(platform_settings, count: int) -> list[CloudEvent]:
    records = asyncio.run(read_records(platform_settings, JOBS.full_name(platform_settings.topic_prefix), count))
    for record in records:
        assert record.key.decode() == CloudEvent.from_kafka(record.headers, record.value).subject
    return sorted((CloudEvent.from_kafka(r.headers, r.value) for r in records), key=lambda e: e.time)


def test_job_succeeds_with_lifecycle_events_in_order(writer: JobClient, job_spec, wait_for,
                                                     platform_settings) -> None:
    submitted = writer.submit(job_spec("hello", "print('hello')", job_class="TE"))
    assert submitted.name == "jobs/hello" and submitted.status.state == pb.JOB_STATE_PENDING
    job = wait_for(writer, "hello", pb.JOB_STATE_SUCCEEDED)
    assert (job.status.attempt, job.status.retries, job.status.cause) == (0, 0, "")
    assert job.spec.job_class == pb.JOB_CLASS_TE and job.spec.roles["worker"].resources.cpu_millis == 1000
    assert job.status.submit_time.ToNanoseconds() <= job.status.start_time.ToNanoseconds() \
        <= job.status.end_time.ToNanoseconds()
    assert [j.status.job_id for j in writer.list()] == ["hello"]
    assert writer.list(state=pb.JOB_STATE_FAILED) == []

    events = _events(platform_settings, 4)
    assert [e.type for e in events] == ["opml.jobs.v1.JobSubmitted", "opml.jobs.v1.JobScheduled",
                                        "opml.jobs.v1.JobStarted", "opml.jobs.v1.JobSucceeded"]
    assert all(e.subject == "hello" and e.source == "opml/job-orchestrator" for e in events)
    assert events[0].parse(events_pb2.JobSubmitted).spec.name == "hello"
    assert "n0" in events[1].parse(events_pb2.JobScheduled).message
    assert events[3].parse(events_pb2.JobSucceeded).status.state == pb.JOB_STATE_SUCCEEDED
    with pytest.raises(AlreadyExists, match="hello"):
        writer.submit(job_spec("hello", "pass"))


BAD_SPECS = [
    (lambda s: s.roles["worker"].resources.__setattr__("gpu", -1), "roles.worker.resources.gpu", ">= 0"),
    (lambda s: s.roles["worker"].__setattr__("replicas", 0), "roles.worker.replicas", ">= 1"),
    (lambda s: s.roles["learner"].resources.__setattr__("cpu_millis", 1), "roles.learner", "not one of"),
    (lambda s: s.__setattr__("job_class", pb.JOB_CLASS_UNSPECIFIED), "job_class", "TE"),
    (lambda s: s.__setattr__("name", "Bad/Name"), "name", "must match"),
    # larger than the whole cluster (one node: 4 cores, 4096 MiB, 1 GPU): rejected at submit
    (lambda s: s.roles["worker"].resources.__setattr__("gpu", 2), "roles.worker.resources.gpu", "largest node has 1"),
    (lambda s: (s.roles["worker"].resources.__setattr__("cpu_millis", 3000),
                s.roles["worker"].__setattr__("replicas", 2)), "roles.worker.replicas", "whole cluster has 4000"),
]


def test_bad_specs_are_invalid_argument_with_the_field_path(job_service, writer: JobClient, tokens,
                                                            job_spec) -> None:
    for change, field, rule in BAD_SPECS:
        spec = job_spec("bad", "pass")
        change(spec)
        with pytest.raises(InvalidArgument) as caught:
            writer.submit(spec)
        assert caught.value.field == field and rule in caught.value.message, caught.value.message
    assert writer.list() == []  # nothing was queued
    with open_channel(job_service.target, token=tokens["writer"]) as channel:  # the bare stub: status as sent
        stub = jobs_pb2_grpc.JobServiceStub(channel)
        for call, details in ((lambda: stub.SubmitJob(pb.SubmitJobRequest()), "spec: is required"),
                              (lambda: stub.GetJob(pb.GetJobRequest(name="bad")), "name: must look like jobs/")):
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and details in caught.value.details()


def test_a_spec_with_four_mistakes_gets_all_four_paths_in_one_error(job_service, writer: JobClient, tokens,
                                                                     job_spec) -> None:
    """Four broken rules, one round trip: the service names every field path, as BadRequest field
    violations beside the message, and the client rebuilds all of them."""
    spec = job_spec("Bad Name", "pass")
    spec.job_class = pb.JOB_CLASS_UNSPECIFIED
    spec.roles["worker"].replicas = 0
    spec.env["LD_PRELOAD"] = "/tmp/evil.so"
    with pytest.raises(InvalidArgument) as caught:
        writer.submit(spec)
    fields = [field for field, _ in caught.value.violations]
    assert sorted(fields) == ["env.LD_PRELOAD", "job_class", "name", "roles.worker.replicas"], caught.value.message
    assert all(field in caught.value.message for field in fields)
    # on the wire: the BadRequest
    with open_channel(job_service.target, token=tokens["writer"]) as channel, pytest.raises(grpc.RpcError) as raw:
        jobs_pb2_grpc.JobServiceStub(channel).SubmitJob(pb.SubmitJobRequest(spec=spec))
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert sorted(f for f, _ in field_violations(raw.value)) == sorted(fields)
    assert writer.list() == []


def test_unknown_command_fails_with_the_executors_error(writer: JobClient, wait_for) -> None:
    from opml_job_orchestrator_contract.jobspec import load_spec
    writer.submit(load_spec({"name": "typo", "class": "TE", "command": ["opml-no-such-command", "--x"],
                             "roles": {"worker": {"resources": {"cpu": 1}}}}))
    job = wait_for(writer, "typo", pb.JOB_STATE_FAILED)
    assert "No such file or directory" in job.status.cause and "opml-no-such-command" in job.status.cause
    assert (job.status.attempt, job.status.retries) == (0, 0)  # not retriable


def test_crash_is_retried_then_succeeds(writer: JobClient, job_spec, wait_for, platform_settings) -> None:
    crash_once = "import os, sys; print('attempt', os.environ['OPML_JOB_ATTEMPT']); " \
                 "sys.exit(7 if os.environ['OPML_JOB_ATTEMPT'] == '0' else 0)"
    writer.submit(job_spec("flaky", crash_once, max_retries=2))
    job = wait_for(writer, "flaky", pb.JOB_STATE_SUCCEEDED)
    assert (job.status.attempt, job.status.retries) == (1, 1)
    assert b"".join(c.data for c in writer.logs("flaky", attempt=0)) == b"attempt 0\n"
    assert b"".join(c.data for c in writer.logs("flaky")) == b"attempt 1\n"
    events = _events(platform_settings, 7)
    assert [e.type.rsplit(".", 1)[1] for e in events] == [
        "JobSubmitted", "JobScheduled", "JobStarted", "JobRetrying", "JobScheduled", "JobStarted", "JobSucceeded"]
    retrying = events[3].parse(events_pb2.JobRetrying)
    assert "retry 1 of 2" in retrying.message and "exited with code 7" in retrying.status.cause


def test_crash_beyond_the_budget_fails_with_the_cause(writer: JobClient, job_spec, wait_for) -> None:
    writer.submit(job_spec("doomed", "import sys; sys.exit(5)", max_retries=1))
    job = wait_for(writer, "doomed", pb.JOB_STATE_FAILED)
    assert (job.status.attempt, job.status.retries) == (1, 1)
    assert "exited with code 5" in job.status.cause


def test_logs_follow_and_watch(writer: JobClient, job_spec, wait_for) -> None:
    code = "import time\nfor i in range(5):\n    print('line', i, flush=True)\n    time.sleep(0.15)"
    with pytest.raises(NotFound, match="talker"):
        next(writer.watch("talker"))
    writer.submit(job_spec("first", "pass"))
    wait_for(writer, "first", pb.JOB_STATE_SUCCEEDED)
    all_jobs = writer.watch()
    assert next(all_jobs).status.job_id == "first"  # where things stand: the watch is in place
    writer.submit(job_spec("talker", code))
    followed = b"".join(c.data for c in writer.logs("talker", follow=True))  # returns when the job ends
    assert followed.decode().splitlines() == [f"line {i}" for i in range(5)]
    changes = list(writer.watch("talker"))  # the job ended: its status now, and the stream ends
    assert [c.status.state for c in changes] == [pb.JOB_STATE_SUCCEEDED]
    seen = []
    for change in all_jobs:
        seen.append((change.kind, change.status.state))
        if change.kind == pb.CHANGE_KIND_SUCCEEDED:
            break
    all_jobs.close()
    assert seen == [(pb.CHANGE_KIND_SUBMITTED, pb.JOB_STATE_PENDING), (pb.CHANGE_KIND_SCHEDULED, pb.JOB_STATE_PENDING),
                    (pb.CHANGE_KIND_STARTED, pb.JOB_STATE_RUNNING),
                    (pb.CHANGE_KIND_SUCCEEDED, pb.JOB_STATE_SUCCEEDED)]
    with pytest.raises(InvalidArgument, match="role"):
        list(writer.logs("talker", role="chief"))


def test_cancel_stops_the_run(writer: JobClient, job_spec, wait_for, file_written, job_dir: Path) -> None:
    pid_file = job_dir / "pid"
    writer.submit(job_spec("sleepy", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
                                     "time.sleep(60)"))
    pid = int(file_written(pid_file))
    job = writer.cancel("sleepy")
    assert (job.status.state, job.status.cause) == (pb.JOB_STATE_CANCELLED, "cancelled")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(FailedPrecondition, match="already cancelled"):
        writer.cancel("sleepy")
    with pytest.raises(NotFound, match="ghost"):
        writer.cancel("ghost")


def test_preempt_needs_admin_and_the_job_resumes(job_service, writer: JobClient, admin: JobClient, tokens,
                                                 job_spec, wait_for, file_written, job_dir: Path) -> None:
    started = job_dir / "started"
    code = (f"import os, time; open({str(started)!r}, 'a').write(os.environ['OPML_JOB_ATTEMPT']); "
            "os.environ['OPML_JOB_ATTEMPT'] == '0' and time.sleep(60)")
    writer.submit(job_spec("long", code))
    file_written(started)
    with pytest.raises(PermissionDenied, match="PreemptJob needs the admin role"):
        writer.preempt("long")
    with JobClient(job_service.target, token=tokens["reader"]) as reader:
        assert reader.get("long").status.state == pb.JOB_STATE_RUNNING
        with pytest.raises(PermissionDenied):
            reader.cancel("long")
    assert admin.preempt("long").status.state == pb.JOB_STATE_PREEMPTED
    job = wait_for(writer, "long", pb.JOB_STATE_SUCCEEDED)
    assert (job.status.attempt, job.status.preemptions, job.status.retries) == (1, 1, 0)
    assert started.read_text() == "01"


def test_health_and_metrics(job_service, writer: JobClient, job_spec, wait_for, service_env) -> None:
    writer.submit(job_spec("counted", "pass", job_class="TE"))
    wait_for(writer, "counted", pb.JOB_STATE_SUCCEEDED)
    with grpc.insecure_channel(job_service.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="opml.jobs.v1.JobService"))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    port = service_env["OPML_JOB_ORCHESTRATOR_METRICS_PORT"]
    deadline = time.monotonic() + 5
    while True:  # the gauge moves in the loop, a moment after the status the client saw
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        if 'opml_job_orchestrator_jobs{job_class="TE",state="succeeded"} 1.0' in text or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert 'opml_job_orchestrator_jobs{job_class="TE",state="succeeded"} 1.0' in text
    assert 'opml_job_orchestrator_job_wait_seconds_count{job_class="TE"} 1.0' in text
    assert "opml_job_orchestrator_scheduling_decision_seconds_count" in text
    assert 'opml_job_orchestrator_grpc_requests_total{code="OK",method="SubmitJob"} 1.0' in text


def test_follow_reads_only_new_output_of_a_log_growing_by_megabytes(writer: JobClient, job_spec) -> None:
    """5 MiB written in bursts while a follower streams it: it gets every byte once, in order, quickly
    (each poll reads from where the last one stopped, not the whole log again)."""
    code = ("import sys, time\n"
            "for burst in range(10):\n"
            "    for i in range(8192):\n"
            "        sys.stdout.write(f'{burst:02d} {i:05d} ' + 'é' * 11 + 'x' * 32 + '\\n')\n"  # 64 bytes a line
            "    sys.stdout.flush()\n"
            "    time.sleep(0.05)\n")
    writer.submit(job_spec("chatty", code))
    started = time.monotonic()
    chunks = list(writer.logs("chatty", follow=True))
    elapsed = time.monotonic() - started
    data = b"".join(c.data for c in chunks)
    expected = "".join(f"{b:02d} {i:05d} " + "é" * 11 + "x" * 32 + "\n" for b in range(10) for i in range(8192))
    assert len(data) == 10 * 8192 * 64 == 5 * 2 ** 20
    assert data == expected.encode()  # nothing twice, nothing lost, no character broken across chunks
    assert all(len(c.data) <= 256 * 1024 for c in chunks)
    # Quickly, against baselines of this run: following costs the job's own span (submit to end, the
    # service's clock) plus a few whole reads of the finished log, not a whole read per poll.
    status = writer.get("chatty").status
    span_s = (status.end_time.ToNanoseconds() - status.submit_time.ToNanoseconds()) / 1e9
    read_started = time.monotonic()
    assert b"".join(c.data for c in writer.logs("chatty")) == data
    read_s = time.monotonic() - read_started
    assert elapsed < 2 * span_s + 10 * read_s, (elapsed, span_s, read_s)
