"""Two job-orchestrator replicas behind the ``job-orchestrator`` lease, as real processes on the session's
Redis and broker: jobs submitted through both run once each when the leader is SIGKILLed under load (the
runs it had going are retried once by its successor, never beside themselves), a leader stalled past
its lease (SIGSTOP) finds its late writes refused when it wakes, and a follower answers the API as the
leader does."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from opml.jobs.v1 import jobs_pb2 as pb

from opml_common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from opml_devstack.process import ServiceProcess
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_job_orchestrator_contract.client import JobClient
from opml_job_orchestrator_contract.pipelineclient import PipelineClient
from opml_job_orchestrator_contract.pipelinespec import load_pipeline

from .conftest import TERMINAL, wait_for_state

# Each run records its pid and which runs of earlier attempts of its job were still alive at its start.
RUN = """
import json, os, pathlib, time
d = pathlib.Path(os.environ["OPML_CHECKPOINT_DIR"])
attempt = os.environ["OPML_JOB_ATTEMPT"]
def alive(pid):
    try:
        os.kill(pid, 0)
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False
earlier = [int(pid) for p in d.glob("runs-*") for pid in p.read_text().split()]
(d / f"alive-{attempt}").write_text(json.dumps([p for p in earlier if alive(p)]))
with open(d / f"runs-{attempt}", "a") as runs:
    runs.write(f"{os.getpid()} ")
time.sleep(float(os.environ.get("RUN_S", "1")) if attempt == "0" else 0.3)
"""

PIPELINE = {"name": "quality", "steps": [
    {"name": "spans", "kind": "ingest", "ingest": {"context": "data"}},
    {"name": "fit", "kind": "train", "inputs": ["spans"], "train": {"command": ["python", "train.py"]}},
]}


@pytest.fixture
def replica(start_service: ServiceStarter, service_env: dict[str, str]) -> Callable[[], ServiceProcess]:
    """Makes replicas: the test's environment (its Redis prefix, its home: the local executor's runs are
    on this one machine) on ports of their own."""
    def make() -> ServiceProcess:
        ports = {k: v for k, v in start_service.env("job-orchestrator").items() if k.endswith("_PORT")}
        return start_service("job-orchestrator", env={**service_env, **ports}, start=False)
    return make


def metrics(process: ServiceProcess) -> str:
    port = process.env["OPML_JOB_ORCHESTRATOR_METRICS_PORT"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        return answer.read().decode()


def leads(process: ServiceProcess) -> bool:
    return "opml_job_orchestrator_leader 1.0" in metrics(process)


def jobs_counted(process: ServiceProcess) -> float:
    """The replica's ``opml_job_orchestrator_jobs`` gauge, summed over states and classes."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics(process).splitlines()
               if line.startswith("opml_job_orchestrator_jobs{"))


def until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> float:
    """Wait for ``condition``; return when it held (monotonic)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen in {timeout_s} s")
        time.sleep(0.02)
    return time.monotonic()


def test_leader_killed_under_load_every_job_ends_once(replica, job_spec, job_dir: Path) -> None:
    first = replica().start()
    until(lambda: leads(first), "the first replica leading")
    second = replica().start()
    assert not leads(second)
    names = [f"job-{i}" for i in range(10)]
    dirs = {name: job_dir / name for name in names}
    with JobClient(first.target, token=TOKENS["writer"]) as a, JobClient(second.target, token=TOKENS["writer"]) as b:
        for index, name in enumerate(names):  # half through the follower, which hands them to the leader
            client = a if index % 2 == 0 else b
            job = client.submit(job_spec(name, RUN, checkpoint={"dir": str(dirs[name])}, env={"RUN_S": "3"}))
            assert job.status.job_id == name
        until(lambda: len([n for n in names if b.get(n).status.state == pb.JOB_STATE_RUNNING]) >= 2,
              "runs going on the leader")
        running = {n for n in names if b.get(n).status.state == pb.JOB_STATE_RUNNING}
        assert any(b.get(n).status.state == pb.JOB_STATE_PENDING for n in names), "jobs queued too"
        first.kill()
        killed = time.monotonic()
        took_over = until(lambda: leads(second), "the follower taking over")
        print(f"\nfailover: the follower led {took_over - killed:.2f} s after the leader's SIGKILL "
              f"(lease TTL {second.env['OPML_JOB_ORCHESTRATOR_LEASE_TTL_S']} s)")
        ended = {n: wait_for_state(b, n, *TERMINAL, timeout_s=60) for n in names}
    for name, job in ended.items():
        assert job.status.state == pb.JOB_STATE_SUCCEEDED, job.status
        runs = {int(p.name.split("-")[1]): p.read_text().split() for p in dirs[name].glob("runs-*")}
        assert job.status.attempt in runs and set(runs) <= set(range(job.status.attempt + 1)), (name, runs)
        assert all(len(pids) == 1 for pids in runs.values()), (name, runs)  # no attempt ran twice
        for attempt in runs:  # nor beside an earlier one
            assert json.loads((dirs[name] / f"alive-{attempt}").read_text()) == [], (name, attempt)
        # A run the leader had going when it died is lost and retried once, as after a restart; one it
        # was launching may have started (retried then) or not (its number is skipped); the others ran once.
        assert job.status.attempt <= 1 and job.status.retries <= 1, (name, job.status)
        if name in running:
            assert (job.status.attempt, job.status.retries) == (1, 1), (name, job.status)


def test_a_stalled_leaders_late_writes_are_refused(replica, job_spec, job_dir: Path) -> None:
    first = replica().start()
    until(lambda: leads(first), "the first replica leading")
    second = replica().start()
    ckpt = job_dir / "stalled"
    with JobClient(second.target, token=TOKENS["writer"]) as b:
        b.submit(job_spec("stalled", RUN, checkpoint={"dir": str(ckpt)}, env={"RUN_S": "60"}))
        wait_for_state(b, "stalled", pb.JOB_STATE_RUNNING)
        os.kill(first.process.pid, signal.SIGSTOP)
        try:
            until(lambda: leads(second), "the follower taking over")
            done = wait_for_state(b, "stalled", pb.JOB_STATE_SUCCEEDED, timeout_s=30)
        finally:
            os.kill(first.process.pid, signal.SIGCONT)
        assert (done.status.attempt, done.status.retries) == (1, 1)
        # The woken leader's run 0 ended (its successor stopped it) and it stops its tenure: each of
        # its writes about it is refused, logged, never applied.
        until(lambda: "snapshot refused" in first.log_path.read_text(), "the woken leader's write refused")
        until(lambda: not leads(first), "the woken leader standing down")
        after = b.get("stalled")
        assert (after.status.state, after.status.attempt, after.status.retries) == (
            pb.JOB_STATE_SUCCEEDED, 1, 1), after.status
        assert b.submit(job_spec("after", "pass")).status.job_id == "after"  # the new leader runs on
        assert wait_for_state(b, "after", pb.JOB_STATE_SUCCEEDED).status.attempt == 0
        until(lambda: jobs_counted(first) == 0, "the deposed leader no longer counting jobs")
        assert jobs_counted(second) == 2


def test_a_follower_serves_the_api_with_the_leaders_answers(replica, job_spec) -> None:
    first = replica().start()
    until(lambda: leads(first), "the first replica leading")
    second = replica().start()
    with JobClient(second.target, token=TOKENS["writer"]) as b, \
            JobClient(second.target, token=TOKENS["admin"]) as b_admin, \
            JobClient(first.target, token=TOKENS["writer"]) as a:
        too_big = job_spec("too-big", "pass")
        too_big.roles["worker"].resources.gpu = 2  # the leader's scheduler refuses it: its field, its rule
        with pytest.raises(InvalidArgument) as caught:
            b.submit(too_big)
        assert caught.value.field == "roles.worker.resources.gpu" and "largest node has 1" in caught.value.message
        queued = b.submit(job_spec("sleeper", "import time; time.sleep(60)"))
        assert queued.status.job_id == "sleeper" and queued.spec.name == "sleeper"
        with pytest.raises(AlreadyExists, match="sleeper"):
            b.submit(job_spec("sleeper", "pass"))
        watch = b.watch("sleeper")  # a follower's watch: the store's changes, up to the end
        wait_for_state(b, "sleeper", pb.JOB_STATE_RUNNING)
        with JobClient(second.target, token=TOKENS["reader"]) as reader, pytest.raises(PermissionDenied):
            reader.cancel("sleeper")
        cancelled = b.cancel("sleeper")
        assert cancelled.status.state == pb.JOB_STATE_CANCELLED
        assert a.get("sleeper").status.state == pb.JOB_STATE_CANCELLED  # the leader's record, not a copy
        states = [change.status.state for change in watch]
        assert states[-1] == pb.JOB_STATE_CANCELLED and pb.JOB_STATE_RUNNING in states, states
        with pytest.raises(FailedPrecondition, match="already cancelled"):
            b_admin.cancel("sleeper")
        assert [j.status.job_id for j in b.list()] == ["sleeper"] == [j.status.job_id for j in a.list()]
        with pytest.raises(NotFound):
            b.get("never")


def test_a_follower_serves_the_pipelines_api_through_the_leader(replica) -> None:
    """No bundle-store answers here: a run stays at its ingest step, which is all a trigger needs."""
    first = replica().start()
    until(lambda: leads(first), "the first replica leading")
    second = replica().start()
    with PipelineClient(second.target, token=TOKENS["writer"]) as b, \
            PipelineClient(second.target, token=TOKENS["admin"]) as b_admin, \
            PipelineClient(first.target, token=TOKENS["reader"]) as a:
        bad = load_pipeline(PIPELINE)
        bad.steps.add().CopyFrom(load_pipeline(PIPELINE).steps[0])  # a second step named spans
        with pytest.raises(InvalidArgument) as raised:
            b.apply(bad)  # the leader's engine's rules, every one
        assert {field for field, _ in raised.value.violations} == {"steps[2].name"}
        applied = b.apply(load_pipeline(PIPELINE))
        assert applied.name == "pipelines/quality" and applied.applied_by.startswith("token:")
        assert [p.spec.name for p in a.list()] == ["quality"] == [p.spec.name for p in b.list()]
        assert b.trigger("quality", "first").run == 1
        assert b.trigger("quality").coalesced  # the leader's one run at a time
        assert b.get("quality").active_run == 1 and a.get("quality").run_pending
        assert [r.number for r in b.runs("quality")] == [1] and b.run("quality", 1).triggers[0].endswith(": first")
        with pytest.raises(FailedPrecondition, match="run 1"):
            b.delete("quality")
        with pytest.raises(FailedPrecondition):
            b_admin.force_bless("quality", 1, "because")
        with pytest.raises(NotFound):
            b.get("ghost")
