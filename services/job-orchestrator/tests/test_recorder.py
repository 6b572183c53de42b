"""The JobRecorder, the orchestrator's lifecycle listener, on an in-process Orchestrator (real
processes, real Redis): every transition saved, announced once through the emitter before the
transition returns, shown to watchers and counted; an event the outbox cannot record does not stop
the job; restored jobs counted as saved."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from google.protobuf.message import Message
from opml.jobs.v1 import events_pb2
from opml.jobs.v1 import jobs_pb2 as pb
from prometheus_client import CollectorRegistry

from opml_common.bus import CloudEvent
from opml_common.config import PlatformSettings
from opml_common.events import RecordingEmitter
from opml_common.metrics import ServiceMetrics
from opml_common.storage import redis_client
from opml_job_orchestrator.convert import job_to_proto
from opml_job_orchestrator.executor import JobProgram, LocalExecutor, RetryPolicy
from opml_job_orchestrator.metrics import JobMetrics
from opml_job_orchestrator.orchestrator import JobState, Orchestrator
from opml_job_orchestrator.recorder import JobRecorder
from opml_job_orchestrator.scheduler import (
    Cluster,
    JobClass,
    JobSpec,
    NodeSpec,
    Resources,
    RoleSpec,
    Scheduler,
    te_be_policy,
)
from opml_job_orchestrator.state import JobStore
from opml_job_orchestrator.watch import WatchHub
from opml_job_orchestrator_contract.topics import JOBS

SLOT = Resources(cpu_millis=1000)


def spec(job_id: str) -> JobSpec:
    return JobSpec(job_id=job_id, job_class=JobClass.TE, roles={"worker": RoleSpec(1, SLOT)})


def program(code: str) -> JobProgram:
    return JobProgram(commands={"worker": [sys.executable, "-c", code]})


class FullDiskEmitter(RecordingEmitter):
    """An emitter whose outbox cannot write: every emit raises as a full disk does."""

    def emit(self, message: Message, *, subject: str) -> CloudEvent:
        raise OSError(28, "No space left on device")


def jobs_gauge(registry: CollectorRegistry, state: str) -> float | None:
    return registry.get_sample_value("opml_job_orchestrator_jobs", {"state": state, "job_class": "TE"})


def recorder(store: JobStore, emitter: RecordingEmitter, watch: WatchHub) -> tuple[JobRecorder, CollectorRegistry]:
    """A recorder whose metrics live in a registry of their own (returned with it)."""
    registry = CollectorRegistry()
    metrics = JobMetrics(ServiceMetrics("job-orchestrator", registry))
    return JobRecorder(store=store, emitter=emitter, watch=watch, metrics=metrics), registry


class Parts:
    """A recorder and what it records into: a real-Redis store, ``emitter``, a watch hub, a metrics registry."""

    def __init__(self, platform_settings: PlatformSettings, emitter: RecordingEmitter) -> None:
        self.redis = redis_client(platform_settings)
        self.prefix = platform_settings.redis_prefix
        self.store = JobStore(self.redis, prefix=self.prefix)
        self.emitter = emitter
        self.watch = WatchHub(limit=100)
        self.recorder, self.registry = recorder(self.store, emitter, self.watch)

    def jobs(self, state: str) -> float | None:
        return jobs_gauge(self.registry, state)

    async def saved(self) -> list[pb.Job]:
        """What Redis holds once every snapshot queued so far is written."""
        await asyncio.wait_for(self.store.flushed(), 5)
        return await JobStore(self.redis, prefix=self.prefix).load()


@pytest.fixture
def emitter() -> RecordingEmitter:
    return RecordingEmitter(source="opml/job-orchestrator")


@pytest.fixture
async def parts(platform_settings: PlatformSettings, emitter: RecordingEmitter) -> AsyncIterator[Parts]:
    made = Parts(platform_settings, emitter)
    await made.store.start()
    try:
        yield made
    finally:
        await made.store.stop()
        await made.redis.aclose()


@pytest.fixture
def orch(tmp_path: Path, parts: Parts) -> Orchestrator:
    """An orchestrator (not started) whose one listener is the recorder; the test starts it with ``async with``."""
    executor = LocalExecutor(work_dir=tmp_path / "work", cleanup_grace_s=1.0, shutdown_grace_s=0.5)
    return Orchestrator(scheduler=Scheduler(Cluster([NodeSpec("n0", SLOT)]), te_be_policy()), executor=executor,
                        retry_policy=RetryPolicy(max_retries=0, base_delay_s=0.05, max_delay_s=0.1), listeners=[parts.recorder], max_wait_s=0.2)


async def test_each_transition_is_saved_announced_once_watched_and_counted(
        orch: Orchestrator, parts: Parts, emitter: RecordingEmitter, until) -> None:
    with parts.watch.subscribe("ok") as watcher:
        orch.submit(spec("ok"), program("print('hello')"))
        # done before submit returned: the event emitted (on disk, in a service) and the snapshot queued
        assert [type(m).__name__ for m in emitter.messages] == ["JobSubmitted"]
        submitted = emitter.messages[0]
        assert submitted.spec.name == "ok" and submitted.status.state == pb.JOB_STATE_PENDING
        assert [(j.status.job_id, j.status.state) for j in await parts.saved()] == [("ok", pb.JOB_STATE_PENDING)]
        async with orch:
            await until(orch, "ok", JobState.SUCCEEDED)
        changes = [await asyncio.wait_for(watcher.next(), 5) for _ in range(4)]

    assert [type(m).__name__ for m in emitter.messages] == ["JobSubmitted", "JobScheduled", "JobStarted",
                                                            "JobSucceeded"]
    assert all(topic == JOBS and event.subject == "ok" and event.source == "opml/job-orchestrator"
               for topic, event in emitter.events)
    assert "n0" in emitter.messages[1].message
    assert isinstance(emitter.messages[3], events_pb2.JobSucceeded)
    assert emitter.messages[3].status.state == pb.JOB_STATE_SUCCEEDED
    assert [(c.kind, c.status.state) for c in changes] == [
        (pb.CHANGE_KIND_SUBMITTED, pb.JOB_STATE_PENDING), (pb.CHANGE_KIND_SCHEDULED, pb.JOB_STATE_PENDING),
        (pb.CHANGE_KIND_STARTED, pb.JOB_STATE_RUNNING), (pb.CHANGE_KIND_SUCCEEDED, pb.JOB_STATE_SUCCEEDED)]
    (saved,) = await parts.saved()
    assert saved == job_to_proto(orch.definition("ok"), orch.get("ok"))  # the latest snapshot, spec and status
    assert (parts.jobs("succeeded"), parts.jobs("pending"), parts.jobs("running")) == (1.0, 0.0, 0.0)
    assert parts.registry.get_sample_value("opml_job_orchestrator_job_wait_seconds_count", {"job_class": "TE"}) == 1


@pytest.mark.parametrize("emitter", [FullDiskEmitter()], ids=["full-disk"])
async def test_an_event_the_outbox_cannot_record_is_logged_and_the_job_goes_on(
        orch: Orchestrator, parts: Parts, caplog: pytest.LogCaptureFixture, until) -> None:
    with caplog.at_level(logging.ERROR, logger="opml_job_orchestrator.recorder"), \
            parts.watch.subscribe("ok") as watcher:
        orch.submit(spec("ok"), program("pass"))
        assert (await asyncio.wait_for(watcher.next(), 5)).kind == pb.CHANGE_KIND_SUBMITTED
        async with orch:
            await until(orch, "ok", JobState.SUCCEEDED)
    assert "could not record the submitted event of job ok in the outbox" in caplog.text
    assert "could not record the succeeded event of job ok in the outbox" in caplog.text
    assert [j.status.state for j in await parts.saved()] == [pb.JOB_STATE_SUCCEEDED]
    assert parts.jobs("succeeded") == 1.0


async def test_load_returns_the_saved_jobs_counted_as_saved(orch: Orchestrator, parts: Parts, until) -> None:
    async with orch:
        orch.submit(spec("done"), program("pass"))
        await until(orch, "done", JobState.SUCCEEDED)
    await parts.saved()

    restarted, registry = recorder(parts.store, RecordingEmitter(), WatchHub())
    saved = await restarted.load()
    assert [(s.definition, s.status) for s in saved] == [(orch.definition("done"), orch.get("done"))]
    assert jobs_gauge(registry, "succeeded") == 1.0 and jobs_gauge(registry, "pending") is None
