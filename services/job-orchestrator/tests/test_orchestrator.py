"""The orchestrator loop with the real scheduler and real processes (LocalExecutor): success,
retries, a command that does not exist, TE/BE preemption with a checkpoint and resume, admin
preemption, cancel, and request errors.

The cluster holds one job at a time. Tasks are small ``python -c`` scripts; the ``orch`` fixture
stops the orchestrator (and so the executor, which kills every task still running) after each test.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from opml_common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from opml_job_orchestrator.executor import JobProgram, LocalExecutor, RetryPolicy
from opml_job_orchestrator.executor.fake_kubernetes import FakeCoreV1Api
from opml_job_orchestrator.executor.kubernetes import KubernetesExecutor, pod_name
from opml_job_orchestrator.orchestrator import (
    EventKind,
    JobDefinition,
    JobState,
    JobStatus,
    LifecycleEvent,
    Orchestrator,
    SavedJob,
)
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

SLOT = Resources(cpu_millis=1000)
RUN = (EventKind.SCHEDULED, EventKind.STARTED)


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def spec(job_id: str, *, te: bool = False, cpu_millis: int = 1000) -> JobSpec:
    return JobSpec(job_id=job_id, job_class=JobClass.TE if te else JobClass.BE,
                   roles={"worker": RoleSpec(1, Resources(cpu_millis=cpu_millis))},
                   checkpoint_interval_s=None if te else 1.0)


def program(code: str, **kwargs: str) -> JobProgram:
    return JobProgram(commands={"worker": py(code)}, **kwargs)


@pytest.fixture
def events() -> list[LifecycleEvent]:
    return []


@pytest.fixture
async def orch(tmp_path: Path, events: list[LifecycleEvent]) -> AsyncIterator[Orchestrator]:
    scheduler = Scheduler(Cluster([NodeSpec("n0", SLOT)]), te_be_policy())
    executor = LocalExecutor(work_dir=tmp_path / "work", cleanup_grace_s=1.0, shutdown_grace_s=0.5)
    async with Orchestrator(scheduler=scheduler, executor=executor,
                            retry_policy=RetryPolicy(max_retries=2, base_delay_s=0.05, max_delay_s=0.1),
                            listeners=[events.append], terminate_grace_s=2.0, max_wait_s=0.2) as o:
        yield o


async def until_file(path: Path, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        await asyncio.sleep(0.02)
    raise AssertionError(f"{path} was not written in {timeout_s} s")


def kinds(events: list[LifecycleEvent], job_id: str) -> list[EventKind]:
    return [e.kind for e in events if e.job_id == job_id]


async def test_job_runs_to_success_with_events_in_order(
        orch: Orchestrator, events: list[LifecycleEvent], until) -> None:
    assert orch.submit(spec("ok"), program("print('hello')")) == "ok"
    status = await until(orch, "ok", JobState.SUCCEEDED)
    assert kinds(events, "ok") == [EventKind.SUBMITTED, EventKind.SCHEDULED, EventKind.STARTED, EventKind.SUCCEEDED]
    assert (status.attempt, status.retries, status.preemptions, status.cause) == (0, 0, 0, None)
    assert status.submitted_at <= status.started_at <= status.ended_at
    assert [s.job_id for s in orch.list()] == ["ok"]


async def test_crash_is_retried_with_the_attempt_visible_then_fails(orch: Orchestrator, events: list[LifecycleEvent],
                                                                   job_dir: Path, until) -> None:
    seen = job_dir / "attempts"
    orch.submit(spec("crash"), program(
        f"import os, sys; open({str(seen)!r}, 'a').write(os.environ['OPML_JOB_ATTEMPT'] + '\\n'); sys.exit(3)"))
    status = await until(orch, "crash", JobState.FAILED)
    assert seen.read_text().split() == ["0", "1", "2"]
    assert (status.attempt, status.retries) == (2, 2)
    assert "exited with code 3" in status.cause
    assert kinds(events, "crash") == [EventKind.SUBMITTED, *RUN, EventKind.RETRYING, *RUN, EventKind.RETRYING,
                                      *RUN, EventKind.FAILED]
    assert [e.attempt for e in events if e.kind is EventKind.STARTED] == [0, 1, 2]


async def test_missing_command_fails_without_retries(orch: Orchestrator, events: list[LifecycleEvent], until) -> None:
    orch.submit(spec("missing"), JobProgram(commands={"worker": ["opml-no-such-command"]}))
    status = await until(orch, "missing", JobState.FAILED)
    assert "No such file or directory" in status.cause
    assert (status.attempt, status.retries) == (0, 0)
    assert kinds(events, "missing") == [EventKind.SUBMITTED, *RUN, EventKind.FAILED]


BE_TRAINER = """
import os, signal, sys, time
ckpt = os.path.join(os.environ["OPML_CHECKPOINT_DIR"], "step")
step = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
first = step
def checkpoint(*_):
    open(ckpt, "w").write(str(step))
    sys.exit(0)
signal.signal(signal.SIGTERM, checkpoint)
open(os.path.join(os.environ["OPML_CHECKPOINT_DIR"], "started"), "a").write(os.environ["OPML_JOB_ATTEMPT"] + " ")
while step < 30:
    if os.environ["OPML_JOB_ATTEMPT"] == "0" and step == 5:  # made progress: hold here until preempted
        open(os.path.join(os.environ["OPML_CHECKPOINT_DIR"], "progress"), "w").write(str(step))
        time.sleep(0.03)
        continue
    step += 1
    time.sleep(0.03)
open(os.path.join(os.environ["OPML_CHECKPOINT_DIR"], "result"), "w").write(
    f"{os.environ['OPML_JOB_ATTEMPT']} {first} {step}")
"""


async def test_be_job_is_preempted_for_a_te_job_and_resumes_from_its_checkpoint(
        orch: Orchestrator, events: list[LifecycleEvent], job_dir: Path, until) -> None:
    ckpt = job_dir / "ckpt"  # made for the job
    orch.submit(spec("be"), program(BE_TRAINER, checkpoint_dir=str(ckpt)))
    assert await until_file(ckpt / "progress") == "5"  # it made progress (and holds until preempted)
    orch.submit(spec("te", te=True), program("import time; time.sleep(0.2)"))

    te = await until(orch, "te", JobState.SUCCEEDED)
    be = await until(orch, "be", JobState.SUCCEEDED)
    attempt, first, last = map(int, (ckpt / "result").read_text().split())
    assert attempt == 1 and first == 5 and last == 30  # resumed from the step it saved
    assert (ckpt / "step").read_text() == str(first)
    assert (be.attempt, be.preemptions, te.attempt) == (1, 1, 0)
    assert kinds(events, "be") == [EventKind.SUBMITTED, *RUN, EventKind.PREEMPTED, EventKind.SCHEDULED,
                                   EventKind.RESUMED, EventKind.SUCCEEDED]
    order = [(e.job_id, e.kind) for e in events if e.kind not in (EventKind.SUBMITTED, EventKind.SCHEDULED)]
    assert order.index(("be", EventKind.PREEMPTED)) < order.index(("te", EventKind.STARTED))
    assert order.index(("te", EventKind.SUCCEEDED)) < order.index(("be", EventKind.RESUMED))
    assert "preempted for job 'te'" in next(e.message for e in events if e.kind is EventKind.PREEMPTED)


async def test_admin_preempt_requeues_the_job_to_resume(
        orch: Orchestrator, events: list[LifecycleEvent], until) -> None:
    orch.submit(spec("long"), program("import os, time; os.environ['OPML_JOB_ATTEMPT'] == '0' and time.sleep(30)"))
    await until(orch, "long", JobState.RUNNING)
    assert (await orch.preempt("long")).state is JobState.PREEMPTED
    status = await until(orch, "long", JobState.SUCCEEDED)
    assert (status.attempt, status.preemptions, status.retries) == (1, 1, 0)
    assert kinds(events, "long") == [EventKind.SUBMITTED, *RUN, EventKind.PREEMPTED, EventKind.SCHEDULED,
                                     EventKind.RESUMED, EventKind.SUCCEEDED]
    with pytest.raises(FailedPrecondition, match="not running"):
        await orch.preempt("long")


async def test_cancel_stops_a_running_job(
        orch: Orchestrator, events: list[LifecycleEvent], job_dir: Path, until) -> None:
    pid_file = job_dir / "pid"
    orch.submit(spec("sleepy"), program(f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
                                        "time.sleep(30)"))
    pid = int(await until_file(pid_file))
    status = await orch.cancel("sleepy")
    assert (status.state, status.cause) == (JobState.CANCELLED, "cancelled")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    orch.submit(spec("next"), program("pass"))  # its room is free again
    await until(orch, "next", JobState.SUCCEEDED)
    assert orch.get("sleepy").state is JobState.CANCELLED  # the run's STOPPED event changed nothing
    assert kinds(events, "sleepy") == [EventKind.SUBMITTED, *RUN, EventKind.CANCELLED]
    with pytest.raises(FailedPrecondition, match="already cancelled"):
        await orch.cancel("sleepy")


async def test_cancel_a_waiting_job(orch: Orchestrator, events: list[LifecycleEvent], until) -> None:
    orch.submit(spec("first"), program("import time; time.sleep(30)"))
    orch.submit(spec("second"), program("pass"))
    await until(orch, "first", JobState.RUNNING)
    assert (await orch.cancel("second")).state is JobState.CANCELLED
    await orch.cancel("first")
    assert kinds(events, "second") == [EventKind.SUBMITTED, EventKind.CANCELLED]


async def test_request_errors(orch: Orchestrator) -> None:
    with pytest.raises(InvalidArgument, match=r"roles\.worker"):
        orch.submit(spec("huge", cpu_millis=2000), program("pass"))
    with pytest.raises(InvalidArgument, match=r"commands\.worker"):
        orch.submit(spec("nocmd"), JobProgram(commands={"chief": py("pass")}))
    orch.submit(spec("once"), program("pass"))
    with pytest.raises(AlreadyExists, match="once"):
        orch.submit(spec("once"), program("pass"))
    with pytest.raises(NotFound, match="ghost"):
        orch.get("ghost")
    with pytest.raises(NotFound, match="ghost"):
        await orch.cancel("ghost")
    assert [s.job_id for s in orch.list()] == ["once"]


async def test_checkpoint_reports_reach_the_status(tmp_path: Path, events: list[LifecycleEvent]) -> None:
    scheduler = Scheduler(Cluster([NodeSpec("n0", SLOT)]), te_be_policy())
    executor = LocalExecutor(work_dir=tmp_path / "work", heartbeat_check_interval_s=0.05, shutdown_grace_s=0.5)
    code = ("import json, os, time; open(os.environ['OPML_HEARTBEAT_FILE'], 'w').write(json.dumps("
            "{'checkpoint_step': 7})); time.sleep(30)")
    async with Orchestrator(scheduler=scheduler, executor=executor, retry_policy=RETRIES,
                            listeners=[events.append], max_wait_s=0.1) as orch:
        orch.submit(spec("ckpt"), program(code))
        deadline = time.monotonic() + 10
        while orch.get("ckpt").checkpoint_step != 7:
            assert time.monotonic() < deadline, orch.get("ckpt")
            await asyncio.sleep(0.02)
        assert scheduler.job("ckpt").last_checkpoint_at is not None  # the preemption policy sees it


async def test_a_jobs_own_retry_budget(orch: Orchestrator, until) -> None:
    orch.submit(spec("once"), program("import sys; sys.exit(1)"), max_retries=0)
    assert (await until(orch, "once", JobState.FAILED)).retries == 0
    orch.submit(spec("thrice"), program("import sys; sys.exit(1)"), max_retries=3)
    assert (await until(orch, "thrice", JobState.FAILED)).retries == 3
    with pytest.raises(InvalidArgument, match="max_retries"):
        orch.submit(spec("bad"), program("pass"), max_retries=-1)


RETRIES = RetryPolicy(max_retries=2, base_delay_s=0.05, max_delay_s=0.1)


async def test_restore_after_a_crash(tmp_path: Path, job_dir: Path, events: list[LifecycleEvent], until) -> None:
    """A first orchestrator 'dies' (is dropped, its run left going); a second one restores its jobs."""
    pid_file = job_dir / "pid"
    code = (f"import os, time; os.environ['OPML_JOB_ATTEMPT'] == '0' and (open({str(pid_file)!r}, 'w')"
            ".write(str(os.getpid())), time.sleep(30))")
    first = Orchestrator(scheduler=Scheduler(Cluster([NodeSpec("n0", SLOT)]), te_be_policy()),
                         executor=LocalExecutor(work_dir=tmp_path / "work", shutdown_grace_s=0.5),
                         retry_policy=RetryPolicy(max_retries=0, base_delay_s=0, max_delay_s=0), max_wait_s=0.1)
    await first.start()  # it never retries: once "dead", it must not launch anything
    first.submit(spec("done"), program("pass"))
    await until(first, "done", JobState.SUCCEEDED)
    first.submit(spec("running"), program(code))
    first.submit(spec("waiting"), program("pass"))
    pid = int(await until_file(pid_file))
    saved = [SavedJob(first.definition(s.job_id), s) for s in first.list()]
    assert [s.status.state for s in saved] == [JobState.SUCCEEDED, JobState.RUNNING, JobState.PENDING]

    second = Orchestrator(scheduler=Scheduler(Cluster([NodeSpec("n0", SLOT)]), te_be_policy()),
                          executor=LocalExecutor(work_dir=tmp_path / "work", shutdown_grace_s=0.5),
                          retry_policy=RETRIES, listeners=[events.append], max_wait_s=0.1)
    try:
        await second.restore(saved)
        with pytest.raises(ProcessLookupError):  # the leftover run is gone before anything launches
            os.kill(pid, 0)
        async with second:
            running = await until(second, "running", JobState.SUCCEEDED)
            assert (running.attempt, running.retries) == (1, 1)
            assert (await until(second, "waiting", JobState.SUCCEEDED)).attempt == 0
            assert second.get("done").state is JobState.SUCCEEDED
        assert kinds(events, "running") == [EventKind.RETRYING, *RUN, EventKind.SUCCEEDED]
        assert "the orchestrator restarted" in next(e.message for e in events if e.kind is EventKind.RETRYING)
        assert kinds(events, "waiting") == [*RUN, EventKind.SUCCEEDED]
        with pytest.raises(FailedPrecondition):
            await second.restore(saved)
    finally:
        await first.stop()


async def test_restore_readopts_kubernetes_pods_where_they_run(
        tmp_path: Path, events: list[LifecycleEvent], until) -> None:
    """Pods outlive the orchestrator: the restored job stays RUNNING, counted on the node its pod is on."""
    api = FakeCoreV1Api(node="node-1")  # its kubelet binds pods to node-1
    first = KubernetesExecutor(image="img", log_dir=tmp_path / "logs", api=api, poll_interval_s=0.02)
    await first.start()
    await first.launch(spec("adopted"), program("train"), {"worker": ("node-1",)}, attempt=0)
    adopted_pod = pod_name("adopted", 0, "worker", 0)
    api.set_running(adopted_pod)  # the orchestrator dies here; `first` is never stopped

    def saved(job_id: str, state: JobState) -> SavedJob:
        status = JobStatus(job_id, state, 0 if state is JobState.RUNNING else -1, 0, 0, None, 1.0,
                           1.0 if state is JobState.RUNNING else None, 1.0, None)
        return SavedJob(JobDefinition(spec(job_id), program("train")), status)

    scheduler = Scheduler(Cluster([NodeSpec("node-0", SLOT), NodeSpec("node-1", SLOT)]), te_be_policy())
    second = Orchestrator(scheduler=scheduler, retry_policy=RETRIES, listeners=[events.append], max_wait_s=0.05,
                          executor=KubernetesExecutor(image="img", log_dir=tmp_path / "logs", api=api,
                                                      poll_interval_s=0.02, delete_timeout_s=1))
    await second.restore([saved("adopted", JobState.RUNNING), saved("next", JobState.PENDING),
                          saved("blocked", JobState.PENDING)])
    assert second.get("adopted").state is JobState.RUNNING
    assert dict(scheduler.running["adopted"].placement) == {"worker": ("node-1",)}  # not placed again on node-0
    async with second:
        await until(second, "next", JobState.RUNNING)
        next_pod = api.pods[pod_name("next", 0, "worker", 0)]
        assert next_pod["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "node-0"}  # the free node
        assert second.get("blocked").state is JobState.PENDING
        api.set_exited(adopted_pod, 0)
        adopted = await until(second, "adopted", JobState.SUCCEEDED)
        assert (adopted.attempt, adopted.retries) == (0, 0)  # the same run went on to the end
        await until(second, "blocked", JobState.RUNNING)
        assert dict(scheduler.running["blocked"].placement) == {"worker": ("node-1",)}
    assert kinds(events, "adopted") == [EventKind.SUCCEEDED]


async def test_a_readopted_run_on_a_node_no_longer_configured_is_stopped_and_queued(
        tmp_path: Path, events: list[LifecycleEvent], until) -> None:
    api = FakeCoreV1Api(node="node-9")
    first = KubernetesExecutor(image="img", log_dir=tmp_path / "logs", api=api, poll_interval_s=0.02)
    await first.start()
    await first.launch(spec("moved"), program("train"), {"worker": ("node-9",)}, attempt=0)
    api.set_running(pod_name("moved", 0, "worker", 0))
    status = JobStatus("moved", JobState.RUNNING, 0, 0, 0, None, 1.0, 1.0, 1.0, None)
    scheduler = Scheduler(Cluster([NodeSpec("node-0", SLOT)]), te_be_policy())  # node-9 left the configuration
    orch = Orchestrator(scheduler=scheduler, retry_policy=RETRIES, listeners=[events.append], max_wait_s=0.05,
                        executor=KubernetesExecutor(image="img", log_dir=tmp_path / "logs", api=api,
                                                    poll_interval_s=0.02, delete_timeout_s=1))
    await orch.restore([SavedJob(JobDefinition(spec("moved"), program("train")), status)])
    moved = orch.get("moved")
    assert moved.state is JobState.PREEMPTED and "node-9" in moved.cause
    assert pod_name("moved", 0, "worker", 0) not in api.pods
    async with orch:
        resumed = await until(orch, "moved", JobState.RUNNING)
        assert resumed.attempt == 1 and dict(scheduler.running["moved"].placement) == {"worker": ("node-0",)}
    assert kinds(events, "moved")[:3] == [EventKind.PREEMPTED, EventKind.SCHEDULED, EventKind.RESUMED]


async def test_a_run_launched_after_the_last_record_is_stopped_and_its_number_not_reused(
        tmp_path: Path, events: list[LifecycleEvent], until) -> None:
    """The store says PENDING, but the dead orchestrator had launched attempt 0: that run is stopped
    on restore, and the job's next run is attempt 1 (pods are named by attempt: no clash)."""
    api = FakeCoreV1Api(node="node-0")
    first = KubernetesExecutor(image="img", log_dir=tmp_path / "logs", api=api, poll_interval_s=0.02)
    await first.start()
    await first.launch(spec("late"), program("train"), {"worker": ("node-0",)}, attempt=0)
    api.set_running(pod_name("late", 0, "worker", 0))
    status = JobStatus("late", JobState.PENDING, -1, 0, 0, None, 1.0, None, 1.0, None)
    scheduler = Scheduler(Cluster([NodeSpec("node-0", SLOT)]), te_be_policy())
    orch = Orchestrator(scheduler=scheduler, retry_policy=RETRIES, listeners=[events.append], max_wait_s=0.05,
                        executor=KubernetesExecutor(image="img", log_dir=tmp_path / "logs", api=api,
                                                    poll_interval_s=0.02, delete_timeout_s=1))
    await orch.restore([SavedJob(JobDefinition(spec("late"), program("train")), status)])
    assert pod_name("late", 0, "worker", 0) not in api.pods and orch.get("late").state is JobState.PENDING
    async with orch:
        assert (await until(orch, "late", JobState.RUNNING)).attempt == 1
        assert pod_name("late", 1, "worker", 0) in api.pods


async def test_a_job_whose_process_cannot_be_given_its_env_fails_alone(
        orch: Orchestrator, events: list[LifecycleEvent], until) -> None:
    """A NUL byte in the env (a job saved before the spec refused it) fails that job; the loop runs the next."""
    orch.submit(spec("nul"), program("pass", env={"MODE": "a\0b"}))
    assert "embedded null byte" in (await until(orch, "nul", JobState.FAILED)).cause
    orch.submit(spec("after-nul"), program("pass"))
    assert (await until(orch, "after-nul", JobState.SUCCEEDED)).attempt == 0


class _BrokenLaunch(LocalExecutor):
    """Raises what no executor promises for one job (a bug, a full disk), after starting its task."""

    started_pid: int | None = None

    async def _launch(self, spec: JobSpec, program: JobProgram, placement: dict[str, tuple[str, ...]], *,
                      attempt: int) -> None:
        await super()._launch(spec, program, placement, attempt=attempt)
        if spec.job_id == "broken":
            self.started_pid = next(iter(self._runs[spec.job_id].tasks.values())).process.pid
            raise RuntimeError("an executor bug")


async def test_an_unexpected_executor_error_fails_that_job_and_the_loop_runs_on(
        tmp_path: Path, events: list[LifecycleEvent], until, alive) -> None:
    scheduler = Scheduler(Cluster([NodeSpec("n0", SLOT)]), te_be_policy())
    executor = _BrokenLaunch(work_dir=tmp_path / "work", shutdown_grace_s=0.5)
    async with Orchestrator(scheduler=scheduler, executor=executor, retry_policy=RETRIES,
                            listeners=[events.append], terminate_grace_s=0.5, max_wait_s=0.1) as orch:
        orch.submit(spec("broken"), program("import time; time.sleep(30)"))
        broken = await until(orch, "broken", JobState.FAILED)
        assert "RuntimeError" in broken.cause and broken.retries == 0
        assert "an executor bug" not in broken.cause  # an unexpected error's text stays in the log
        assert kinds(events, "broken") == [EventKind.SUBMITTED, EventKind.SCHEDULED, EventKind.FAILED]
        assert executor.started_pid is not None and not alive(executor.started_pid)  # stopped with its run
        orch.submit(spec("next"), program("pass"))
        await until(orch, "next", JobState.SUCCEEDED)


def restored(job_id: str, state: JobState, job_spec: JobSpec, code: str = "pass") -> SavedJob:
    running = state is JobState.RUNNING
    status = JobStatus(job_id, state, 0 if running or state is JobState.RETRYING else -1, 0, 0, None, 1.0,
                       1.0 if running else None, 1.0, None)
    return SavedJob(JobDefinition(job_spec, program(code)), status)


async def test_restored_retries_the_smaller_cluster_cannot_hold_fail_and_the_loop_runs_on(
        tmp_path: Path, events: list[LifecycleEvent], until) -> None:
    """A run lost in the restart, and a job saved RETRYING whose replicas no longer pack, both fail
    at restore with the reason; they never reach the loop's submit."""
    unpackable = JobSpec(job_id="unpackable", job_class=JobClass.BE,
                         roles={"worker": RoleSpec(3, Resources(cpu_millis=600))})  # 1800 of 2000, one per node
    scheduler = Scheduler(Cluster([NodeSpec("n0", SLOT), NodeSpec("n1", SLOT)]), te_be_policy())
    orch = Orchestrator(scheduler=scheduler, retry_policy=RETRIES, listeners=[events.append], max_wait_s=0.05,
                        executor=LocalExecutor(work_dir=tmp_path / "work", shutdown_grace_s=0.5))
    await orch.restore([restored("lost", JobState.RUNNING, spec("lost", cpu_millis=1500)),
                        restored("unpackable", JobState.RETRYING, unpackable),
                        restored("fits", JobState.PENDING, spec("fits"))])
    for job_id in ("lost", "unpackable"):
        failed = orch.get(job_id)
        assert failed.state is JobState.FAILED and "cluster can no longer hold it" in failed.cause, failed
    async with orch:
        await until(orch, "fits", JobState.SUCCEEDED)
    assert kinds(events, "lost") == [EventKind.RETRYING, EventKind.FAILED]


class _RefusesResubmits(Scheduler):
    """Refuses a job the second time it is submitted, as a reconfigured cluster would its retry."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.seen: set[str] = set()

    def submit(self, spec: JobSpec, *, now: float):
        if spec.job_id in self.seen:
            raise InvalidArgument("roles", "cannot be packed onto the nodes")
        self.seen.add(spec.job_id)
        return super().submit(spec, now=now)


async def test_a_retry_the_scheduler_refuses_fails_that_job_and_the_loop_runs_on(
        tmp_path: Path, events: list[LifecycleEvent], until) -> None:
    scheduler = _RefusesResubmits(Cluster([NodeSpec("n0", SLOT)]), te_be_policy())
    async with Orchestrator(scheduler=scheduler, retry_policy=RETRIES, listeners=[events.append], max_wait_s=0.05,
                            executor=LocalExecutor(work_dir=tmp_path / "work", shutdown_grace_s=0.5)) as orch:
        orch.submit(spec("refused"), program("import sys; sys.exit(1)"))
        refused = await until(orch, "refused", JobState.FAILED)
        assert "cannot be packed" in refused.cause and refused.retries == 1
        orch.submit(spec("next"), program("pass"))
        await until(orch, "next", JobState.SUCCEEDED)


class _BrokenSchedule(Scheduler):
    """A scheduler with a bug: scheduling raises once a job waits."""

    def schedule(self, *, now: float):
        if self.pending_count:
            raise RuntimeError("a scheduler bug")
        return super().schedule(now=now)


async def test_loop_ended_raises_what_killed_the_loop_and_returns_after_a_stop(tmp_path: Path) -> None:
    """What the service waits on in the background: a dead loop must end the service, not hide."""
    orch = Orchestrator(scheduler=_BrokenSchedule(Cluster([NodeSpec("n0", SLOT)]), te_be_policy()),
                        executor=LocalExecutor(work_dir=tmp_path / "work", shutdown_grace_s=0.5), retry_policy=RETRIES,
                        max_wait_s=0.05)
    with pytest.raises(FailedPrecondition, match="not started"):
        orch.loop_ended()
    await orch.start()
    ended = orch.loop_ended()
    orch.submit(spec("any"), program("pass"))
    with pytest.raises(RuntimeError, match="a scheduler bug"):
        await ended
    with pytest.raises(RuntimeError, match="a scheduler bug"):
        await orch.stop()
    healthy = Orchestrator(scheduler=Scheduler(Cluster([NodeSpec("n0", SLOT)]), te_be_policy()),
                           executor=LocalExecutor(work_dir=tmp_path / "work2", shutdown_grace_s=0.5),
                           retry_policy=RETRIES)
    await healthy.start()
    ended = healthy.loop_ended()
    await healthy.stop()
    assert await ended is None
