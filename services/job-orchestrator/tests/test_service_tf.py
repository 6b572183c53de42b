"""Real TensorFlow jobs through the real service: a job-orchestrator process on the session's tansu
and Redis, jobs submitted through its gRPC API, events read back from the broker.

(a) A two-worker MultiWorkerMirroredStrategy job: both workers' logs, fetched through the API, show
the TF_CONFIG task each was given, and the job's lifecycle events are on the JOBS topic in order.
(b) A job submitted with ``trace: true`` runs under the trace collector's launcher, and the tracer
inside it reports to the same broker (the task gets the platform's settings): its TracerStarted and
StepMetricsBatch events, filed under the job's id, are on the TRACES topic.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from opml.jobs.v1 import jobs_pb2 as pb
from opml.traces.v1 import events_pb2 as traces_pb

from opml_common.bus import CloudEvent, ensure_topics
from opml_devstack.testing.bus import read_records
from opml_job_orchestrator_contract.client import JobClient
from opml_job_orchestrator_contract.jobspec import load_spec
from opml_job_orchestrator_contract.topics import JOBS
from opml_trace_collector_contract.topics import TRACES

pytestmark = pytest.mark.slow  # TensorFlow is in the test extra: these always run under make test

PROGRAMS = Path(__file__).parent / "programs"
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}


def _events(platform_settings, topic: str, count: int) -> list[CloudEvent]:
    records = asyncio.run(read_records(platform_settings, topic, count, timeout_s=30))
    return sorted((CloudEvent.from_kafka(r.headers, r.value) for r in records), key=lambda e: e.time)


def test_two_worker_job_through_the_api(writer: JobClient, wait_for, platform_settings) -> None:
    writer.submit(load_spec({
        "name": "mwms", "class": "TE", "env": TF_ENV, "max_retries": 0,
        "command": [sys.executable, str(PROGRAMS / "multi_worker_train.py")],
        "roles": {"worker": {"replicas": 2, "resources": {"cpu": 1, "memory": "1Gi"}}}}))
    job = wait_for(writer, "mwms", pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, timeout_s=90)
    logs = [b"".join(c.data for c in writer.logs("mwms", role="worker", index=i, attempt=0)).decode() for i in (0, 1)]
    assert job.status.state == pb.JOB_STATE_SUCCEEDED and (job.status.attempt, job.status.retries) == (0, 0), logs
    for i, log in enumerate(logs):
        assert f"task worker {i} of cluster {{'worker': [" in log, log
        assert "replicas in sync: 2" in log and "step 24 loss" in log
    weights = [next(line for line in log.splitlines() if line.startswith("final weights")) for log in logs]
    assert weights[0] == weights[1]  # one model, trained on two workers

    events = _events(platform_settings, JOBS.full_name(platform_settings.topic_prefix), 4)
    assert [e.type.rsplit(".", 1)[1] for e in events] == ["JobSubmitted", "JobScheduled", "JobStarted",
                                                           "JobSucceeded"]
    assert all(e.subject == "mwms" for e in events)


def test_traced_job_reports_to_the_platforms_broker(writer: JobClient, wait_for, platform_settings, service_env,
                                                    job_dir: Path) -> None:
    """Sandboxed (the tests run as root), the job's tracer spools in its run's own folder, and its
    shipper, running as the job's user, publishes from there."""
    asyncio.run(ensure_topics(platform_settings, [TRACES]))  # the trace collector's service creates it in production
    env = {**TF_ENV, "OPML_TRACE_SESSION_DIR": str(job_dir / "s"), "OPML_TRACE_FLUSH_INTERVAL_S": "0.5"}
    writer.submit(load_spec({
        "name": "traced", "class": "TE", "env": env, "trace": True, "checkpoint": {"dir": str(job_dir / "ckpt")},
        "max_retries": 0,
        "command": [sys.executable, str(PROGRAMS / "resumable_train.py"), "--steps", "20", "--step-seconds", "0.05"],
        "roles": {"worker": {"resources": {"cpu": 1, "memory": "1Gi"}}}}))
    job = wait_for(writer, "traced", pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, timeout_s=90)
    log = b"".join(c.data for c in writer.logs("traced", attempt=0)).decode()
    assert job.status.state == pb.JOB_STATE_SUCCEEDED and job.status.attempt == 0, log
    assert "finished at step 20" in log, log

    events = _events(platform_settings, TRACES.full_name(platform_settings.topic_prefix), 3)
    types = [e.type for e in events]
    assert "opml.traces.v1.TracerStarted" in types and "opml.traces.v1.StepMetricsBatch" in types, types
    started = next(e for e in events if e.type.endswith("TracerStarted")).parse(traces_pb.TracerStarted)
    assert (started.job, started.worker) == ("traced", "worker-0")
    batches = [e.parse(traces_pb.StepMetricsBatch) for e in events if e.type.endswith("StepMetricsBatch")]
    assert all(b.job == "traced" for b in batches)
    assert sum(len(b.steps) for b in batches) >= 20, [len(b.steps) for b in batches]  # every training step
    spool = Path(service_env["OPML_JOB_ORCHESTRATOR_HOME"]) / "work" / "traced" / "attempt-0" / "sandbox" / "trace-spool"
    assert spool.is_dir() and not list(spool.rglob("*.json"))  # all delivered, nothing left waiting in the spool
