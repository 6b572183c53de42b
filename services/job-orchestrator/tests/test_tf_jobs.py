"""Real TensorFlow jobs on the local executor: a two-worker MultiWorkerMirroredStrategy job, a BE job
preempted for a TE job and resumed from its checkpoint, a retry after an injected crash, and a job
traced by the trace collector's launcher.

The jobs are the example programs in ``programs/`` (CPU TensorFlow, a few seconds each), sandboxed
where the tests run as root, as the service runs them (their checkpoint folders are made for the
job's user in ``job_dir``); the preemption and the retry go through the real Orchestrator and Scheduler. A cluster of one 1-CPU
node holds one job at a time, so a TE job can only start by preempting the BE job.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import pytest

from opml_devstack.devinfra import free_port
from opml_job_orchestrator.executor import (
    CheckpointEvent,
    Executor,
    ExecutorEvent,
    JobEvent,
    JobOutcome,
    JobProgram,
    LocalExecutor,
    RetryPolicy,
    TaskEvent,
    TaskState,
)
from opml_job_orchestrator.orchestrator import EventKind, JobState, LifecycleEvent, Orchestrator
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

pytestmark = pytest.mark.slow  # TensorFlow is in the test extra: these always run under make test
# A safety net, not a speed bound: each attempt is a TensorFlow process, whose import alone took 30 s on a
# 2-core machine at load 10 (a 40-step job with one retry did not end within 60 s there).
JOB_WAIT_S = 200

PROGRAMS = Path(__file__).parent / "programs"
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
NODE = Resources(cpu_millis=1000)


def program(script: str, *args: str, checkpoint_dir: Path | None = None, role: str = "worker") -> JobProgram:
    return JobProgram(commands={role: [sys.executable, str(PROGRAMS / script), *args]}, env=TF_ENV,
                      checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None)


def job(job_id: str, job_class: JobClass = JobClass.BE, workers: int = 1) -> JobSpec:
    return JobSpec(job_id=job_id, job_class=job_class, roles={"worker": RoleSpec(workers, NODE)},
                   checkpoint_interval_s=1.0 if job_class is JobClass.BE else None)


class Recording(Executor):
    """Wraps an executor and keeps every event its poll returns, for the test to read."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.events: list[ExecutorEvent] = []

    async def start(self) -> None:
        await self.inner.start()

    async def stop(self) -> None:
        await self.inner.stop()

    async def launch(self, spec: JobSpec, program: JobProgram, placement: Mapping[str, Sequence[str]], *,
                     attempt: int) -> None:
        await self.inner.launch(spec, program, placement, attempt=attempt)

    async def recover(self, job_id: str, attempt: int) -> Mapping[str, tuple[str, ...]] | None:
        return await self.inner.recover(job_id, attempt)

    async def terminate(self, job_id: str, grace_s: float) -> None:
        await self.inner.terminate(job_id, grace_s)

    async def poll(self, timeout_s: float) -> list[ExecutorEvent]:
        events = await self.inner.poll(timeout_s)
        self.events += events
        return events

    async def logs(self, job_id: str, role: str, index: int, *, attempt: int | None = None, offset: int = 0) -> str:
        return await self.inner.logs(job_id, role, index, attempt=attempt, offset=offset)


@pytest.fixture
def lifecycle() -> list[LifecycleEvent]:
    return []


@pytest.fixture
def executor(tmp_path: Path) -> Recording:
    return Recording(LocalExecutor(work_dir=tmp_path / "work", heartbeat_check_interval_s=0.2, cleanup_grace_s=5.0,
                                   shutdown_grace_s=2.0))


@pytest.fixture
async def orch(executor: Recording, lifecycle: list[LifecycleEvent]) -> AsyncIterator[Orchestrator]:
    scheduler = Scheduler(Cluster([NodeSpec("n0", NODE)]), te_be_policy())
    async with Orchestrator(scheduler=scheduler, executor=executor,
                            retry_policy=RetryPolicy(max_retries=2, base_delay_s=0.1, max_delay_s=0.5),
                            listeners=[lifecycle.append], terminate_grace_s=30.0, max_wait_s=0.2) as o:
        yield o


def milestones(lifecycle: list[LifecycleEvent], job_id: str) -> list[EventKind]:
    """The job's runs starting and ending (other lifecycle events left out)."""
    kept = {EventKind.STARTED, EventKind.PREEMPTED, EventKind.RESUMED, EventKind.RETRYING, EventKind.SUCCEEDED,
            EventKind.FAILED}
    return [e.kind for e in lifecycle if e.job_id == job_id and e.kind in kept]


def metrics(checkpoint_dir: Path) -> list[dict]:
    path = checkpoint_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def mean_loss(rows: list[dict]) -> float:
    return sum(r["loss"] for r in rows) / len(rows)


async def test_two_worker_multi_worker_mirrored_strategy_job(executor: Recording, until_job_event, job_event) -> None:
    spec = job("mwms", workers=2)
    async with executor:
        await executor.launch(spec, program("multi_worker_train.py"), {"worker": ("n0", "n0")}, attempt=0)
        event = job_event(await until_job_event(executor, "mwms", timeout_s=JOB_WAIT_S))
        logs = [await executor.logs("mwms", "worker", i) for i in (0, 1)]
    assert event.outcome is JobOutcome.SUCCEEDED, (event, logs)
    finished = [e for e in executor.events if isinstance(e, TaskEvent) and e.state is TaskState.SUCCEEDED]
    assert sorted(e.index for e in finished) == [0, 1]
    clusters, weights = [], []
    for i, log in enumerate(logs):
        lines = log.splitlines()
        task = next(line for line in lines if line.startswith("task "))
        assert task.startswith(f"task worker {i} of cluster ")
        clusters.append(task.split(" of cluster ", 1)[1])
        assert "replicas in sync: 2" in lines and "step 24 loss" in log
        weights.append(next(line for line in lines if line.startswith("final weights")))
    assert clusters[0] == clusters[1] and clusters[0].count("127.0.0.1:") == 2
    assert weights[0] == weights[1]  # gradients were all-reduced: one model trained on two workers


async def test_be_job_preempted_for_a_te_job_resumes_from_its_tensorflow_checkpoint(
        orch: Orchestrator, executor: Recording, lifecycle: list[LifecycleEvent], job_dir: Path, until) -> None:
    be_dir, te_dir = job_dir / "be", job_dir / "te"
    total = 60
    orch.submit(job("be"), program("resumable_train.py", "--steps", str(total), "--step-seconds", "0.1",
                                   checkpoint_dir=be_dir))
    deadline = time.monotonic() + JOB_WAIT_S
    while len(metrics(be_dir)) < 15:  # well into training, past a periodic checkpoint
        assert time.monotonic() < deadline, await executor.logs("be", "worker", 0)
        await asyncio.sleep(0.1)
    orch.submit(job("te", JobClass.TE), program("resumable_train.py", "--steps", "5", checkpoint_dir=te_dir))

    te = await until(orch, "te", JobState.SUCCEEDED, timeout_s=JOB_WAIT_S)
    be = await until(orch, "be", JobState.SUCCEEDED, JobState.FAILED, timeout_s=JOB_WAIT_S)
    first_log = await executor.logs("be", "worker", 0, attempt=0)
    resumed_log = await executor.logs("be", "worker", 0, attempt=1)
    assert be.state is JobState.SUCCEEDED, resumed_log
    assert (be.attempt, be.preemptions, be.retries, te.attempt) == (1, 1, 0, 0)
    assert milestones(lifecycle, "be") == [EventKind.STARTED, EventKind.PREEMPTED, EventKind.RESUMED,
                                           EventKind.SUCCEEDED]
    order = [(e.job_id, e.kind) for e in lifecycle]
    assert order.index(("be", EventKind.PREEMPTED)) < order.index(("te", EventKind.STARTED))
    assert order.index(("te", EventKind.SUCCEEDED)) < order.index(("be", EventKind.RESUMED))

    rows = metrics(be_dir)
    stopped_at = max(r["step"] for r in rows if r["attempt"] == 0)
    assert f"saved step {stopped_at} (preempted)" in first_log  # SIGTERM: it saved, then exited
    assert "attempt 0 starts at step 0" in first_log
    assert f"attempt 1 starts at step {stopped_at} of {total}" in resumed_log and stopped_at > 0
    assert [r["step"] for r in rows] == list(range(1, total + 1))  # every step once: nothing redone, nothing lost
    assert [r["attempt"] for r in rows] == [0] * stopped_at + [1] * (total - stopped_at)
    before, after = rows[:stopped_at], rows[stopped_at:]
    assert mean_loss(after[:5]) < 0.5 * mean_loss(before[:5])  # the model went on learning, not from scratch
    assert f"finished at step {total}" in resumed_log
    reported = [e.step for e in executor.events if isinstance(e, CheckpointEvent) and e.job_id == "be"]
    assert stopped_at in reported and total in reported and reported == sorted(reported)


async def test_crashed_job_is_retried_and_resumes_from_its_checkpoint(
        orch: Orchestrator, executor: Recording, lifecycle: list[LifecycleEvent], job_dir: Path, until) -> None:
    total = 40
    ckpt = job_dir / "crashy"
    orch.submit(job("crashy"), program("resumable_train.py", "--steps", str(total), "--crash-at-step", "20",
                                       "--step-seconds", "0.05", checkpoint_dir=ckpt))
    status = await until(orch, "crashy", JobState.SUCCEEDED, JobState.FAILED, timeout_s=JOB_WAIT_S)
    retry_log = await executor.logs("crashy", "worker", 0, attempt=1)
    assert status.state is JobState.SUCCEEDED, retry_log
    assert (status.attempt, status.retries, status.preemptions) == (1, 1, 0)
    assert milestones(lifecycle, "crashy") == [EventKind.STARTED, EventKind.RETRYING, EventKind.STARTED,
                                               EventKind.SUCCEEDED]
    (failure,) = [e for e in executor.events if isinstance(e, JobEvent) and e.outcome is JobOutcome.FAILED]
    assert failure.retriable and failure.message == "worker 0 exited with code 3"
    assert "injected crash" in await executor.logs("crashy", "worker", 0, attempt=0)
    assert f"attempt 1 starts at step 20 of {total}" in retry_log
    rows = metrics(ckpt)
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    assert [(r["attempt"], r["step"]) for r in rows if r["step"] in (20, 21)] == [(0, 20), (1, 21)]
    reported = [(e.attempt, e.step) for e in executor.events if isinstance(e, CheckpointEvent)]
    assert reported == [(0, 10), (0, 20), (1, 30), (1, 40)]


async def test_a_traced_job_runs_unchanged_under_the_trace_collector(
        executor: Recording, job_dir: Path, until_job_event, job_event) -> None:
    nowhere = f"127.0.0.1:{free_port()}"  # a broker address where none listens: the tracer spools its events
    sessions = job_dir / "sessions"
    env = {**TF_ENV, "OPML_KAFKA_BOOTSTRAP": nowhere, "OPML_TRACE_SPOOL_DIR": str(job_dir / "spool"),
           "OPML_TRACE_SESSION_DIR": str(sessions), "OPML_TRACE_EXIT_TIMEOUT_S": "1"}  # sandboxed: the run's spool
    traced = JobProgram(commands={"worker": [sys.executable, str(PROGRAMS / "resumable_train.py"), "--steps", "5"]},
                        env=env, checkpoint_dir=str(job_dir / "ckpt"), trace=True)
    async with executor:
        await executor.launch(job("traced"), traced, {"worker": ("n0",)}, attempt=0)
        event = job_event(await until_job_event(executor, "traced", timeout_s=JOB_WAIT_S))
        log = await executor.logs("traced", "worker", 0)
    assert event.outcome is JobOutcome.SUCCEEDED, log
    assert "finished at step 5" in log
    files = list((sessions / "traced").glob("worker-0.*.jsonl"))  # the trace is filed under the job and task
    assert len(files) == 1, list(sessions.rglob("*"))
    steps = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert sum(step.get("kind") == "STEP_KIND_TRAIN" for step in steps) >= 5, steps[:3]  # every training step
