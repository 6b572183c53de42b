"""One suite for every Executor: the interface's contract, run against each implementation.

The same real programs (small ``python -c`` scripts) run on the local executor (processes) and on
the Kubernetes executor, whose API here is ``FakeCoreV1Api`` with ``run_commands_in``: its stand-in
kubelet runs each pod's command as a local process and deletes pods with SIGTERM, then SIGKILL
after the grace period. No cluster runs here, so for Kubernetes this checks the executor's side of
the contract against a fake API server, not a real one.
"""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound
from opml_job_orchestrator.executor import (
    Executor,
    ExecutorEvent,
    JobOutcome,
    JobProgram,
    LocalExecutor,
    TaskEvent,
    TaskState,
)
from opml_job_orchestrator.executor.fake_kubernetes import FakeCoreV1Api
from opml_job_orchestrator.executor.kubernetes import KubernetesExecutor
from opml_job_orchestrator.scheduler import JobClass, JobSpec, Resources, RoleSpec

SLEEP = "import time; time.sleep(30)"


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def spec(job_id: str, **replicas: int) -> JobSpec:
    return JobSpec(job_id=job_id, job_class=JobClass.BE,
                   roles={role: RoleSpec(n, Resources(cpu_millis=100)) for role, n in replicas.items()})


def placement(job: JobSpec) -> dict[str, tuple[str, ...]]:
    return {role: ("node-0",) * s.replicas for role, s in job.roles.items()}


def local(tmp_path: Path) -> tuple[Executor, Callable[[], None]]:
    return LocalExecutor(work_dir=tmp_path / "work", heartbeat_check_interval_s=0.1, cleanup_grace_s=1.0,
                         shutdown_grace_s=0.5), lambda: None


def kubernetes(tmp_path: Path) -> tuple[Executor, Callable[[], None]]:
    api = FakeCoreV1Api(run_commands_in=tmp_path / "kubelet")
    return KubernetesExecutor(image="img", log_dir=tmp_path / "logs", api=api, node_label=None, poll_interval_s=0.02,
                              cleanup_grace_s=1.0, shutdown_grace_s=0.5, delete_timeout_s=2.0), api.close


@pytest.fixture(params=[local, kubernetes], ids=["local", "kubernetes"])
async def executor(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Executor]:
    ex, close = request.param(tmp_path)
    try:
        async with ex:
            yield ex
    finally:
        close()


async def until_running(ex: Executor, job_id: str, tasks: int, timeout_s: float = 15.0) -> list[ExecutorEvent]:
    seen: list[ExecutorEvent] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen += await ex.poll(0.1)
        if sum(isinstance(e, TaskEvent) and e.state is TaskState.RUNNING for e in seen) == tasks:
            return seen
    raise AssertionError(f"{job_id!r}: not {tasks} tasks running in {timeout_s} s; saw {seen}")


async def test_chief_exit_ends_the_run_without_awaiting_ps_and_the_job_event_comes_last(
        executor: Executor, until_job_event, job_event, task_states) -> None:
    job = spec("tony", chief=1, worker=1, ps=1)
    program = JobProgram(commands={"chief": py("import time; time.sleep(0.3)"), "worker": py(SLEEP),
                                   "ps": py(SLEEP)})
    await executor.launch(job, program, placement(job), attempt=0)
    events = await until_job_event(executor, "tony")
    assert task_states(events) == {("chief", 0): [TaskState.RUNNING, TaskState.SUCCEEDED],
                                   ("worker", 0): [TaskState.RUNNING, TaskState.STOPPED],
                                   ("ps", 0): [TaskState.RUNNING, TaskState.STOPPED]}
    event = job_event(events)
    assert (event.outcome, event.attempt) == (JobOutcome.SUCCEEDED, 0)
    assert events[-1] is event


async def test_without_a_chief_every_worker_must_succeed(
        executor: Executor, until_job_event, job_event, task_states) -> None:
    job = spec("workers", worker=2, ps=1)
    code = "import os, time; time.sleep(0.1 + 0.5 * int(os.environ['OPML_TASK_INDEX']))"
    await executor.launch(job, JobProgram(commands={"worker": py(code), "ps": py(SLEEP)}), placement(job), attempt=0)
    events = await until_job_event(executor, "workers")
    assert job_event(events).outcome is JobOutcome.SUCCEEDED
    assert [task_states(events)[("worker", i)][-1] for i in (0, 1)] == [TaskState.SUCCEEDED] * 2
    assert task_states(events)[("ps", 0)][-1] is TaskState.STOPPED


async def test_a_crash_fails_the_run_retriably_and_stops_the_rest(
        executor: Executor, until_job_event, job_event, task_states) -> None:
    job = spec("crash", worker=2)
    code = "import os, sys, time; i = int(os.environ['OPML_TASK_INDEX']); time.sleep(30 * (1 - i)); sys.exit(3)"
    await executor.launch(job, JobProgram(commands={"worker": py(code)}), placement(job), attempt=4)
    events = await until_job_event(executor, "crash")
    event = job_event(events)
    assert (event.outcome, event.retriable, event.attempt) == (JobOutcome.FAILED, True, 4)
    assert "worker 1 exited with code 3" in event.message
    (failed,) = [e for e in events if isinstance(e, TaskEvent) and e.state is TaskState.FAILED]
    assert (failed.role, failed.index, failed.exit_code) == ("worker", 1, 3)
    assert task_states(events)[("worker", 0)] == [TaskState.RUNNING, TaskState.STOPPED]


async def test_terminate_sends_sigterm_first_and_ends_the_run_stopped(
        executor: Executor, job_dir: Path, until_job_event, job_event, task_states) -> None:
    saved = job_dir / "saved"
    code = ("import pathlib, signal, sys, time\n"
            f"save = lambda *_: (pathlib.Path({str(saved)!r}).write_text('ckpt'), sys.exit(0))\n"
            "signal.signal(signal.SIGTERM, save)\n"
            "print('ready', flush=True)\n"
            "time.sleep(30)\n")
    job = spec("be", worker=1)
    await executor.launch(job, JobProgram(commands={"worker": py(code)}), placement(job), attempt=0)
    events = await until_running(executor, "be", 1)
    while "ready" not in await executor.logs("be", "worker", 0):
        events += await executor.poll(0.05)
    await executor.terminate("be", 10)
    assert saved.read_text() == "ckpt"
    events += await until_job_event(executor, "be")
    assert task_states(events) == {("worker", 0): [TaskState.RUNNING, TaskState.STOPPED]}
    assert job_event(events).outcome is JobOutcome.STOPPED
    await executor.terminate("be", 0)  # ended already: nothing to do
    assert "ready" in await executor.logs("be", "worker", 0)  # still readable after the run


async def test_logs_of_every_task_and_attempt(executor: Executor, until_job_event, job_event) -> None:
    job = spec("logs", worker=2)
    code = ("import os, sys; print('out', os.environ['OPML_TASK_INDEX'], os.environ['OPML_JOB_ATTEMPT'], flush=True); "
            "print('err', os.environ['OPML_TASK_INDEX'], file=sys.stderr)")
    for attempt in (0, 1):
        await executor.launch(job, JobProgram(commands={"worker": py(code)}), placement(job), attempt=attempt)
        assert job_event(await until_job_event(executor, "logs")).outcome is JobOutcome.SUCCEEDED
    for i in (0, 1):
        text = await executor.logs("logs", "worker", i)
        assert f"out {i} 1" in text and f"err {i}" in text
    assert "out 0 0" in await executor.logs("logs", "worker", 0, attempt=0)
    with pytest.raises(NotFound):
        await executor.logs("logs", "worker", 7)
    with pytest.raises(NotFound, match="never launched"):
        await executor.logs("nope", "worker", 0)


async def test_request_errors_are_the_same_everywhere(executor: Executor, until_job_event, job_event) -> None:
    job = spec("bad", chief=1, worker=2)
    program = JobProgram(commands={"chief": py(SLEEP), "worker": py(SLEEP)})
    with pytest.raises(InvalidArgument, match=r"^commands.worker: "):
        await executor.launch(job, JobProgram(commands={"chief": py(SLEEP)}), placement(job), attempt=0)
    with pytest.raises(InvalidArgument, match=r"^placement.worker: "):
        await executor.launch(job, program, {"chief": ("a",), "worker": ("a",)}, attempt=0)
    with pytest.raises(InvalidArgument, match=r"^attempt: "):
        await executor.launch(job, program, placement(job), attempt=-1)
    with pytest.raises(InvalidArgument, match=r"^timeout_s: "):
        await executor.poll(-1)
    with pytest.raises(NotFound, match="never launched"):
        await executor.terminate("other", 1)
    await executor.launch(job, program, placement(job), attempt=0)
    with pytest.raises(FailedPrecondition, match="still runs attempt 0"):
        await executor.launch(job, program, placement(job), attempt=1)
    with pytest.raises(FailedPrecondition, match="still runs attempt 0"):
        await executor.recover("bad", 1)
    assert await executor.recover("bad", 0) == placement(job)  # the run it tracks: nothing to do
    await executor.terminate("bad", 0.5)
    assert job_event(await until_job_event(executor, "bad")).outcome is JobOutcome.STOPPED


async def test_recovering_a_run_of_which_nothing_is_left_reports_it_stopped_and_retriable(
        executor: Executor, until_job_event, job_event) -> None:
    assert await executor.recover("ghost", 3) is None
    event = job_event(await until_job_event(executor, "ghost"))
    assert (event.outcome, event.attempt, event.retriable) == (JobOutcome.STOPPED, 3, True)
    with pytest.raises(NotFound):
        await executor.logs("ghost", "worker", 0)
    job = spec("ghost", worker=1)
    await executor.launch(job, JobProgram(commands={"worker": py("print('fresh')")}), placement(job), attempt=4)
    assert job_event(await until_job_event(executor, "ghost")).outcome is JobOutcome.SUCCEEDED
    assert "fresh" in await executor.logs("ghost", "worker", 0)


async def test_logs_from_a_byte_offset(executor: Executor, until_job_event, job_event) -> None:
    job = spec("offsets", worker=1)
    code = "import sys; sys.stdout.buffer.write('héllo wörld\\n'.encode() + bytes([0xff]) + b'end')"
    await executor.launch(job, JobProgram(commands={"worker": py(code)}), placement(job), attempt=0)
    assert job_event(await until_job_event(executor, "offsets")).outcome is JobOutcome.SUCCEEDED
    whole = await executor.logs("offsets", "worker", 0)
    raw = whole.encode("utf-8", "surrogateescape")
    assert raw == "héllo wörld\n".encode() + b"\xffend"  # exactly the bytes written, even invalid ones
    for offset in range(len(raw) + 1):  # every cut, through the middle of a character too
        assert (await executor.logs("offsets", "worker", 0, offset=offset)).encode("utf-8", "surrogateescape") \
            == raw[offset:]
    assert await executor.logs("offsets", "worker", 0, offset=len(raw) + 10) == ""
    with pytest.raises(InvalidArgument, match=r"^offset: "):
        await executor.logs("offsets", "worker", 0, offset=-1)
