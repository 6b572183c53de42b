"""Fixtures: a real job-orchestrator process on free ports, wired to the session's real infrastructure
(tansu, Redis), with auth on, a small one-node cluster and short retry delays and grace periods."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from opml.jobs.v1 import jobs_pb2 as pb

from opml_common.devinfra import free_port
from opml_common.process import ServiceProcess
from opml_job_orchestrator.client import JobClient
from opml_job_orchestrator.spec import load_spec

TOKENS = {"admin": "admin-token", "writer": "writer-token", "reader": "reader-token"}
NODE = {"name": "n0", "cpu_millis": 4000, "memory_mib": 4096, "gpu": 1}
TERMINAL = {pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED}


@pytest.fixture
def service_env(settings_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The environment of a job-orchestrator process for this test (same Redis prefix on a restart)."""
    return {
        **settings_env,
        "OPML_JOB_ORCHESTRATOR_HOME": str(tmp_path / "home"),
        "OPML_JOB_ORCHESTRATOR_GRPC_PORT": str(free_port()),
        "OPML_JOB_ORCHESTRATOR_METRICS_PORT": str(free_port()),
        "OPML_JOB_ORCHESTRATOR_NODES": json.dumps([NODE]),
        "OPML_JOB_ORCHESTRATOR_RETRY_BASE_DELAY_S": "0.1",
        "OPML_JOB_ORCHESTRATOR_RETRY_MAX_DELAY_S": "0.2",
        "OPML_JOB_ORCHESTRATOR_TERMINATE_GRACE_S": "2",
        "OPML_JOB_ORCHESTRATOR_SHUTDOWN_GRACE_S": "1",
        "OPML_JOB_ORCHESTRATOR_LOG_POLL_S": "0.05",
        "OPML_AUTH_TOKENS": ",".join(f"{token}={role}" for role, token in TOKENS.items()),
    }


@pytest.fixture
def service_process(service_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[[], ServiceProcess]]:
    """Makes job-orchestrator processes with this test's environment (started by the caller);
    every one made is stopped after the test."""
    made: list[ServiceProcess] = []

    def make() -> ServiceProcess:
        process = ServiceProcess("opml_job_orchestrator", int(service_env["OPML_JOB_ORCHESTRATOR_GRPC_PORT"]),
                                 service_env, tmp_path / "job-orchestrator.log")
        made.append(process)
        return process

    yield make
    for process in made:
        process.stop()


@pytest.fixture
def job_service(service_process: Callable[[], ServiceProcess]) -> ServiceProcess:
    """A running job-orchestrator with auth on (tokens in TOKENS), stopped after the test."""
    return service_process().start()


@pytest.fixture
def tokens() -> dict[str, str]:
    return dict(TOKENS)


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
