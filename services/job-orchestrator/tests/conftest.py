"""Fixtures: a real job-orchestrator process on free ports, wired to the session's real infrastructure
(tansu, Redis), with auth on, a small one-node cluster and short retry delays and grace periods; and
bounded waits on what an in-process Executor or Orchestrator reports."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from opml.jobs.v1 import jobs_pb2 as pb

from opml_devstack.process import ServiceProcess
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_job_orchestrator.executor import Executor, ExecutorEvent, JobEvent, TaskEvent, TaskState
from opml_job_orchestrator.orchestrator import JobState, JobStatus, Orchestrator
from opml_job_orchestrator_contract.client import JobClient
from opml_job_orchestrator_contract.jobspec import load_spec

NODE = {"name": "n0", "cpu_millis": 4000, "memory_mib": 4096, "gpu": 1}
TERMINAL = {pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED}


@pytest.fixture
def service_env(start_service: ServiceStarter) -> dict[str, str]:
    """The environment of a job-orchestrator process for this test (same ports, home and Redis prefix
    on a restart)."""
    return start_service.env("job-orchestrator", extra_env={
        "OPML_JOB_ORCHESTRATOR_NODES": json.dumps([NODE]),
        "OPML_JOB_ORCHESTRATOR_RETRY_BASE_DELAY_S": "0.1",
        "OPML_JOB_ORCHESTRATOR_RETRY_MAX_DELAY_S": "0.2",
        "OPML_JOB_ORCHESTRATOR_TERMINATE_GRACE_S": "2",
        "OPML_JOB_ORCHESTRATOR_SHUTDOWN_GRACE_S": "1",
        "OPML_JOB_ORCHESTRATOR_LOG_POLL_S": "0.05",
        "OPML_JOB_ORCHESTRATOR_LEASE_TTL_S": "2",  # a killed leader's successor takes over within 2 s
    })


@pytest.fixture
def service_process(start_service: ServiceStarter, service_env: dict[str, str]) -> Callable[[], ServiceProcess]:
    """Makes job-orchestrator processes with this test's environment (started by the caller);
    every one made is stopped after the test."""
    return lambda: start_service("job-orchestrator", env=service_env, start=False)


@pytest.fixture
def job_service(service_process: Callable[[], ServiceProcess]) -> ServiceProcess:
    """A running job-orchestrator with auth on (the plugin's ``tokens``), stopped after the test."""
    return service_process().start()


@pytest.fixture
def writer(job_service: ServiceProcess) -> Iterator[JobClient]:
    with JobClient(job_service.target, token=TOKENS["writer"]) as client:
        yield client


@pytest.fixture
def admin(job_service: ServiceProcess) -> Iterator[JobClient]:
    with JobClient(job_service.target, token=TOKENS["admin"]) as client:
        yield client


def python_job(name: str, code: str, *, job_class: str = "BE", **extra: object) -> pb.JobSpec:
    """A one-worker job running ``python -c code`` (the test's Python)."""
    return load_spec({"name": name, "class": job_class, "command": [sys.executable, "-c", code],
                      "roles": {"worker": {"resources": {"cpu": 1, "memory": "64Mi"}}}, **extra})


@pytest.fixture
def job_spec() -> Callable[..., pb.JobSpec]:
    return python_job


def wait_for_state(client: JobClient, job_id: str, *states: int, timeout_s: float = 20.0) -> pb.Job:
    deadline = time.monotonic() + timeout_s
    while True:
        job = client.get(job_id)
        if job.status.state in states:
            return job
        if time.monotonic() > deadline or (job.status.state in TERMINAL and not TERMINAL & set(states)):
            raise AssertionError(f"job {job_id} is not {[pb.JobState.Name(s) for s in states]}: {job.status}")
        time.sleep(0.05)


@pytest.fixture
def wait_for() -> Callable[..., pb.Job]:
    """``wait_for(client, job_id, *states)``: poll until the job is in one of ``states``."""
    return wait_for_state


def wait_for_file(path: Path, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and (text := path.read_text()):
            return text
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written in {timeout_s} s")


@pytest.fixture
def file_written() -> Callable[..., str]:
    """``file_written(path)``: wait until the file has content; return it."""
    return wait_for_file


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def alive() -> Callable[[int], bool]:
    """``alive(pid)``: whether the process runs (a zombie awaiting its reaper counts as dead)."""
    return pid_alive


async def until_job_event_of(ex: Executor, job_id: str, timeout_s: float = 15.0) -> list[ExecutorEvent]:
    seen: list[ExecutorEvent] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen += await ex.poll(0.05)
        if any(isinstance(e, JobEvent) and e.job_id == job_id for e in seen):
            return seen
    raise AssertionError(f"no JobEvent for {job_id!r} in {timeout_s} s; saw {seen}")


@pytest.fixture
def until_job_event() -> Callable[..., Awaitable[list[ExecutorEvent]]]:
    """``await until_job_event(executor, job_id, timeout_s=15)``: every event the executor reports up to
    and including ``job_id``'s JobEvent."""
    return until_job_event_of


def the_job_event(events: list[ExecutorEvent]) -> JobEvent:
    (event,) = [e for e in events if isinstance(e, JobEvent)]
    return event


@pytest.fixture
def job_event() -> Callable[[list[ExecutorEvent]], JobEvent]:
    """``job_event(events)``: the one JobEvent among ``events`` (fails if there are none or several)."""
    return the_job_event


def states_by_task(events: list[ExecutorEvent]) -> dict[tuple[str, int], list[TaskState]]:
    found: dict[tuple[str, int], list[TaskState]] = {}
    for e in events:
        if isinstance(e, TaskEvent):
            found.setdefault((e.role, e.index), []).append(e.state)
    return found


@pytest.fixture
def task_states() -> Callable[[list[ExecutorEvent]], dict[tuple[str, int], list[TaskState]]]:
    """``task_states(events)``: the states each task ``(role, index)`` went through, in order."""
    return states_by_task


async def until_orchestrated(orch: Orchestrator, job_id: str, *states: JobState, timeout_s: float = 10.0) -> JobStatus:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = orch.get(job_id)
        if status.state in states:
            return status
        await asyncio.sleep(0.02)
    raise AssertionError(f"job {job_id!r} not {[s.name for s in states]} in {timeout_s} s: {orch.get(job_id)}")


@pytest.fixture
def until() -> Callable[..., Awaitable[JobStatus]]:
    """``await until(orch, job_id, *states, timeout_s=10)``: poll an in-process Orchestrator until the job
    is in one of ``states``; return its status."""
    return until_orchestrated
