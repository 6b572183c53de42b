"""Runs every task of a job as an OS process on this machine: for development and tests.

Each task gets a free port on ``host`` and a TF_CONFIG naming every other task's address, as
TensorFlow expects; node names in the placement are ignored (every node is this machine). A task
runs in its own process group (its own session), so stopping it stops its children too, with its
stdout and stderr going to ``{work_dir}/{job_id}/attempt-{n}/{role}-{index}.log``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound

from opml_job_orchestrator.executor.base import (
    Executor,
    ExecutorEvent,
    JobEvent,
    JobOutcome,
    JobProgram,
    TaskEvent,
    TaskState,
    check_placement,
    check_seconds,
)
from opml_job_orchestrator.scheduler.model import JobSpec

CLUSTER_ROLES = ("chief", "worker", "ps")
"""Roles listed in TF_CONFIG's ``cluster``: TensorFlow wants the evaluator left out of it."""


@dataclass(eq=False)
class _Task:
    role: str
    index: int
    log_path: Path
    heartbeat_path: Path | None
    process: asyncio.subprocess.Process | None = None
    state: TaskState = TaskState.RUNNING
    exited: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False)
class _Run:
    job_id: str
    attempt: int
    program: JobProgram
    tasks: dict[tuple[str, int], _Task]
    awaited: frozenset[tuple[str, int]]
    """The tasks whose exit 0 makes the run succeed: the chief, or every worker if no chief."""
    outcome: JobOutcome | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class LocalExecutor(Executor):
    """Runs each replica of each role as a local process; see :class:`Executor` for the contract.

    Keyword-only settings, checked here: ``work_dir`` holds logs and heartbeat files;
    ``host`` is the address tasks listen on; ``heartbeat_check_interval_s`` is how often
    heartbeat files are checked (for programs with a ``heartbeat_timeout_s``); ``cleanup_grace_s``
    is the grace given, between SIGTERM and SIGKILL, to the tasks still running when a run ends
    on its own (parameter servers, for one); ``shutdown_grace_s`` is the grace :meth:`stop` gives.

    :meth:`launch` starts the tasks one by one, in the order of ``spec.replicas``; if one cannot
    start, the tasks after it are never started (and have no events) and the run fails.
    A task is LOST only through its heartbeat: a process that exits always has an exit code here.
    """

    def __init__(self, *, work_dir: str | os.PathLike[str], host: str = "127.0.0.1",
                 heartbeat_check_interval_s: float = 1.0, cleanup_grace_s: float = 10.0,
                 shutdown_grace_s: float = 10.0) -> None:
        if not isinstance(work_dir, str | os.PathLike) or not str(work_dir):
            raise InvalidArgument("work_dir", f"`work_dir` must be a directory path, but got {work_dir!r}.")
        if not isinstance(host, str) or not host:
            raise InvalidArgument("host", f"`host` must be a non-empty address, but got {host!r}.")
        self._work_dir = Path(work_dir)
        self._host = host
        self._check_interval_s = check_seconds(heartbeat_check_interval_s, "heartbeat_check_interval_s",
                                               positive=True)
        self._cleanup_grace_s = check_seconds(cleanup_grace_s, "cleanup_grace_s", positive=False)
        self._shutdown_grace_s = check_seconds(shutdown_grace_s, "shutdown_grace_s", positive=False)
        self._runs: dict[str, _Run] = {}
        self._attempts: dict[str, set[int]] = {}
        self._events: asyncio.Queue[ExecutorEvent] = asyncio.Queue()
        self._background: set[asyncio.Task[None]] = set()
        self._watcher: asyncio.Task[None] | None = None
        self._started = False

    async def start(self) -> None:
        """Create ``work_dir`` and start the heartbeat watcher. Idempotent."""
        if self._started:
            return
        self._work_dir.mkdir(parents=True, exist_ok=True)
        self._watcher = asyncio.create_task(self._watch_heartbeats())
        self._started = True

    async def stop(self) -> None:
        """Terminate every run still going (grace ``shutdown_grace_s``), stop the heartbeat watcher.

        Idempotent. Logs stay in ``work_dir``; unread events stay readable with :meth:`poll`.
        """
        if not self._started:
            return
        self._started = False
        await asyncio.gather(*(self._end(run, JobOutcome.STOPPED, "the executor stopped", retriable=False,
                                         grace_s=self._shutdown_grace_s) for run in list(self._runs.values())))
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        await asyncio.gather(*self._background)

    async def launch(self, spec: JobSpec, program: JobProgram, placement: Mapping[str, Sequence[str]], *,
                     attempt: int) -> None:
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
            raise InvalidArgument("attempt", f"`attempt` must be an integer >= 0, but got {attempt!r}.")
        program.check_covers(spec)
        check_placement(spec, placement)
        if not self._started:
            raise FailedPrecondition("the executor is not started; call start() or use `async with` first.")
        previous = self._runs.get(spec.job_id)
        if previous is not None and previous.outcome is None:
            raise FailedPrecondition(f"job {spec.job_id!r} still runs attempt {previous.attempt}; terminate it "
                                     "before launching it again.")
        run_dir = self._work_dir / spec.job_id / f"attempt-{attempt}"
        run_dir.mkdir(parents=True, exist_ok=True)
        tasks = {(r.role, r.index): _Task(r.role, r.index, run_dir / f"{r.role}-{r.index}.log",
                                          run_dir / f"{r.role}-{r.index}.heartbeat"
                                          if program.heartbeat_timeout_s is not None else None)
                 for r in spec.replicas}
        awaited_role = "chief" if "chief" in spec.roles else "worker"
        run = _Run(spec.job_id, attempt, program, tasks,
                   frozenset(key for key in tasks if key[0] == awaited_role))
        self._runs[spec.job_id] = run
        self._attempts.setdefault(spec.job_id, set()).add(attempt)
        cluster = self._cluster(spec)
        for task in tasks.values():
            failure = await self._spawn(run, task, cluster)
            if failure is not None:
                for unstarted in tasks.values():
                    if unstarted.process is None and unstarted is not task:
                        unstarted.state = TaskState.STOPPED
                        unstarted.exited.set()
                self._in_background(self._end(run, JobOutcome.FAILED, failure, retriable=False,
                                              grace_s=self._cleanup_grace_s))
                return

    async def terminate(self, job_id: str, grace_s: float) -> None:
        grace_s = check_seconds(grace_s, "grace_s", positive=False)
        run = self._runs.get(job_id)
        if run is None:
            raise NotFound(f"job {job_id!r} was never launched on this executor.")
        await self._end(run, JobOutcome.STOPPED, f"terminated with a grace period of {grace_s:g} s",
                        retriable=False, grace_s=grace_s)

    async def poll(self, timeout_s: float) -> list[ExecutorEvent]:
        timeout_s = check_seconds(timeout_s, "timeout_s", positive=False)
        events: list[ExecutorEvent] = []
        if self._events.empty():
            with contextlib.suppress(TimeoutError):
                events.append(await asyncio.wait_for(self._events.get(), timeout_s))
        while not self._events.empty():
            events.append(self._events.get_nowait())
        return events

    async def logs(self, job_id: str, role: str, index: int, *, attempt: int | None = None) -> str:
        attempts = self._attempts.get(job_id)
        if not attempts:
            raise NotFound(f"job {job_id!r} was never launched on this executor.")
        if attempt is None:
            attempt = self._runs[job_id].attempt
        if attempt not in attempts:
            raise NotFound(f"job {job_id!r} has no attempt {attempt!r}; it has {sorted(attempts)}.")
        path = self._work_dir / job_id / f"attempt-{attempt}" / f"{role}-{index}.log"
        try:
            return await asyncio.to_thread(path.read_text, encoding="utf-8", errors="replace")
        except FileNotFoundError:
            raise NotFound(f"job {job_id!r} attempt {attempt} has no task {role!r} {index!r}.") from None

    def _cluster(self, spec: JobSpec) -> dict[str, list[str]]:
        """TF_CONFIG's ``cluster``: a distinct free port on ``host`` per chief, worker and ps task."""
        with contextlib.ExitStack() as stack:
            cluster: dict[str, list[str]] = {}
            for role in CLUSTER_ROLES:
                if role not in spec.roles:
                    continue
                addresses = cluster[role] = []
                for _ in range(spec.roles[role].replicas):
                    sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.bind((self._host, 0))
                    addresses.append(f"{self._host}:{sock.getsockname()[1]}")
            return cluster

    async def _spawn(self, run: _Run, task: _Task, cluster: dict[str, list[str]]) -> str | None:
        """Start one task; return why it could not start, or None."""
        env = dict(os.environ)
        env.update(run.program.env)
        env.update({
            "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task.role, "index": task.index}}),
            "OPML_JOB_ID": run.job_id,
            "OPML_JOB_ATTEMPT": str(run.attempt),
            "OPML_TASK_TYPE": task.role,
            "OPML_TASK_INDEX": str(task.index),
        })
        if run.program.checkpoint_dir is not None:
            env["OPML_CHECKPOINT_DIR"] = run.program.checkpoint_dir
        if task.heartbeat_path is not None:
            task.heartbeat_path.touch()
            env["OPML_HEARTBEAT_FILE"] = str(task.heartbeat_path)
        argv = run.program.commands[task.role]
        with task.log_path.open("wb") as log:
            try:
                task.process = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT,
                    env=env, start_new_session=True)
            except OSError as exc:
                reason = f"{exc.strerror}: {exc.filename!r}" if exc.filename else str(exc)
                message = f"{task.role} {task.index} could not start: {reason}"
                task.state = TaskState.FAILED
                task.exited.set()
                self._emit(run, task, TaskState.FAILED, message=message)
                return message
        self._emit(run, task, TaskState.RUNNING, message=f"pid {task.process.pid}")
        self._in_background(self._wait(run, task))
        return None

    async def _wait(self, run: _Run, task: _Task) -> None:
        """Report the task's exit, and end the run if that decides it."""
        assert task.process is not None
        code = await task.process.wait()
        _kill_group(task.process.pid, signal.SIGKILL)
        if task.state is TaskState.LOST:
            task.exited.set()
            return
        if run.outcome is not None:
            task.state = TaskState.STOPPED
            message = f"stopped, {_describe(code)}"
        elif code == 0:
            task.state = TaskState.SUCCEEDED
            message = "exited with code 0"
        else:
            task.state = TaskState.FAILED
            message = f"{task.role} {task.index} {_describe(code)}"
        self._emit(run, task, task.state, exit_code=code, message=message)
        task.exited.set()
        if task.state is TaskState.FAILED:
            await self._end(run, JobOutcome.FAILED, message, retriable=True, grace_s=self._cleanup_grace_s)
        elif task.state is TaskState.SUCCEEDED and all(
                run.tasks[key].state is TaskState.SUCCEEDED for key in run.awaited):
            await self._end(run, JobOutcome.SUCCEEDED, f"{', '.join(f'{r} {i}' for r, i in sorted(run.awaited))} "
                            "exited with code 0", retriable=False, grace_s=self._cleanup_grace_s)

    async def _end(self, run: _Run, outcome: JobOutcome, message: str, *, retriable: bool, grace_s: float) -> None:
        """End the run once: SIGTERM what still runs, SIGKILL after ``grace_s``, then report the JobEvent."""
        if run.outcome is not None:
            await run.done.wait()
            return
        run.outcome = outcome
        running = [t for t in run.tasks.values() if not t.exited.is_set() and t.process is not None]
        for task in running:
            _kill_group(task.process.pid, signal.SIGTERM)
        waits = [asyncio.create_task(t.exited.wait()) for t in running]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=grace_s)
            for task in running:
                if not task.exited.is_set():
                    _kill_group(task.process.pid, signal.SIGKILL)
            await asyncio.gather(*pending)
        self._events.put_nowait(JobEvent(run.job_id, run.attempt, outcome, message, retriable))
        run.done.set()

    async def _watch_heartbeats(self) -> None:
        """Every ``heartbeat_check_interval_s``, declare LOST the tasks whose heartbeat file went stale."""
        while True:
            await asyncio.sleep(self._check_interval_s)
            now = time.time()
            for run in list(self._runs.values()):
                timeout_s = run.program.heartbeat_timeout_s
                if run.outcome is not None or timeout_s is None:
                    continue
                for task in run.tasks.values():
                    if task.state is not TaskState.RUNNING or task.heartbeat_path is None or task.process is None:
                        continue
                    try:
                        silent_s = now - task.heartbeat_path.stat().st_mtime
                    except FileNotFoundError:
                        silent_s = float("inf")
                    if silent_s > timeout_s:
                        self._lose(run, task, f"{task.role} {task.index} sent no heartbeat for {silent_s:.1f} s "
                                              f"(heartbeat_timeout_s is {timeout_s:g}) to {task.heartbeat_path}")
                        break

    def _lose(self, run: _Run, task: _Task, message: str) -> None:
        """Report ``task`` LOST, kill it, and fail the run."""
        assert task.process is not None
        task.state = TaskState.LOST
        self._emit(run, task, TaskState.LOST, message=message)
        _kill_group(task.process.pid, signal.SIGKILL)
        self._in_background(self._end(run, JobOutcome.FAILED, message, retriable=True,
                                      grace_s=self._cleanup_grace_s))

    def _emit(self, run: _Run, task: _Task, state: TaskState, *, exit_code: int | None = None,
              message: str = "") -> None:
        self._events.put_nowait(TaskEvent(run.job_id, run.attempt, task.role, task.index, state, exit_code, message))

    def _in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        job = asyncio.create_task(coro)
        self._background.add(job)
        job.add_done_callback(self._background.discard)


def _kill_group(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the process group ``pid`` leads; a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"
