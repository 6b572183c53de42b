"""Runs every task of a job as an OS process on this machine: the embedded default, for development and tests.

Each task gets a free port on ``host`` and a TF_CONFIG naming every other task's address, as
TensorFlow expects; node names in the placement are ignored (every node is this machine). A task
runs in its own process group (its own session), so stopping it stops its children too, with its
stdout and stderr going to ``{work_dir}/{job_id}/attempt-{n}/{role}-{index}.log``.

Each task also gets a heartbeat file (``OPML_HEARTBEAT_FILE``): touching it is a heartbeat, and
writing ``{"checkpoint_step": N}`` to it reports a checkpoint (the executor reads at most
:data:`MAX_HEARTBEAT_BYTES` of a regular file, never following a link). Each run leaves a manifest,
``run.json`` beside its logs (every task's process group, start time, address and log), so a
restarted orchestrator's new executor can stop what the old one left running (:meth:`recover`).

Traced tasks only write their events to the host's trace spool; the executor runs the shipper that
publishes them (``opml_trace_collector.inject.ship``, one per spool folder its traced tasks use, started
with the first such task, logging to ``{work_dir}/trace-shipper.log``). A shipper exits once its spool
has nothing left to ship for ``trace_shipper_idle_exit_s`` (a job that sets its own spool folder, an
automl trial, leaves no shipper behind); each traced task starts it again as it starts and as it ends
(what a task spooled after an early exit is shipped then), and the executor stops what still runs,
so no shipper outlives the executor. Where another shipper already holds the outlet (a job run by
hand), that one publishes.

A task whose replica asks for GPUs (``resources.gpu``) gets that many devices of this machine's
(``devices``, default :func:`opml_common.gpus.discover`'s), each held by one task at a time, as
``CUDA_VISIBLE_DEVICES`` (whatever the job's env says); every other task gets it empty, so it cannot
take a device another job holds. The devices come back when the run ends. The scheduler counts the
machine's GPUs (the default node has as many as are found), so a run finds its devices free; where
the cluster declares more than the executor has, the task that finds too few free cannot start, saying so.

Sandboxed (``sandbox``, :mod:`~opml_job_orchestrator.executor.sandbox`; the default where the executor
runs as root), each job's tasks run as a user of their own in a mount namespace of their own: its
``/proc`` lists only that user's processes, and the run's sandbox folder (``{run}/sandbox``: each
task's working directory, ``HOME`` and ``TMPDIR``, its heartbeat file, the run's trace spool) is at
``/run/opml-job``. The run's trace spool is its own (``OPML_TRACE_SPOOL_DIR``, whatever the job's env
says: a folder the job chose would have the shipper read where the job points) and its shipper runs
as the job's user, logging to ``{run}/trace-shipper.log``. Signals, process groups, exit codes and
logs are the same either way: the sandbox is entered by the task's own process before its command.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_ISREG
from typing import Any

from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound
from opml_common.gpus import VISIBLE_DEVICES, DevicePool, GpuDevice, discover
from opml_common.lifecycle import cancel_and_wait
from opml_common.ports import hold_free_port
from opml_job_orchestrator.executor.base import (
    CheckpointEvent,
    ExecutorEvent,
    JobOutcome,
    JobProgram,
    attempts_logged,
    check_offset,
    check_seconds,
    read_log,
)
from opml_job_orchestrator.executor.sandbox import (
    DEFAULT_UID_BASE,
    DEFAULT_UID_COUNT,
    MOUNT_POINT,
    CouldNotStart,
    RunSandbox,
    Sandbox,
    check_settings,
)
from opml_job_orchestrator.executor.tony import (
    CLUSTER_ROLES,
    TRACE_SHIPPER,
    RunTracker,
    TaskKey,
    Verdict,
    awaited_tasks,
    base_env,
    task_argv,
    task_env,
    trace_launcher_missing,
)
from opml_job_orchestrator.executor.tracked import TrackedRun, TrackedRunExecutor
from opml_job_orchestrator.scheduler.model import JobSpec

MANIFEST = "run.json"
MAX_HEARTBEAT_BYTES = 4096
"""The most of a heartbeat file read: a checkpoint report is a few bytes, and the task writes the file."""
logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Task:
    key: TaskKey
    log_path: Path
    heartbeat_path: Path
    process: asyncio.subprocess.Process | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    beat: tuple[int, int] | None = None
    """``(st_mtime_ns, st_size)`` of the heartbeat file when last read: a change means a new write."""
    beat_at: float = 0.0
    """When the task last touched its heartbeat file (epoch seconds)."""
    devices: tuple[GpuDevice, ...] = ()
    """The GPUs it holds (``CUDA_VISIBLE_DEVICES``) until its run ends."""


@dataclass(eq=False)
class _Run(TrackedRun):
    tasks: dict[TaskKey, _Task]
    heartbeat_timeout_s: float | None
    checkpoints: set[int] = field(default_factory=set)
    """The steps already reported as CheckpointEvents: each once per run, whichever task reports it."""
    held_ports: list[socket.socket] = field(default_factory=list)
    """What holds TF_CONFIG's ports for the tasks until the run ends (see :meth:`LocalExecutor._cluster`)."""
    trace_spool: str | None = None
    """The spool folder of the run's traced tasks ("": the tracer's default); None: the run is not traced."""
    sandbox: RunSandbox | None = None
    """The run's sandbox; None: its tasks run as the executor's user."""


class LocalExecutor(TrackedRunExecutor[_Run]):
    """Runs each replica of each role as a local process; see :class:`Executor` for the contract.

    Keyword-only settings, checked here: ``work_dir`` holds logs, heartbeat files and run
    manifests; ``host`` is the address tasks listen on; ``heartbeat_check_interval_s`` is how
    often heartbeat files are read (for checkpoint reports, and for programs with a
    ``heartbeat_timeout_s``); ``cleanup_grace_s`` is the grace given, between SIGTERM and SIGKILL,
    to the tasks still running when a run ends on its own (parameter servers, for one);
    ``shutdown_grace_s`` is the grace :meth:`stop` and :meth:`recover` give (logs stay in
    ``work_dir`` after either). A task does not inherit this process's environment: it gets
    only the allow-listed variables of it (:func:`~opml_job_orchestrator.executor.tony.base_env`:
    ``PATH``, ``HOME``, ``LANG``, ``LC_*``, ``TZ``), then ``platform_env`` (what the service gives
    jobs: the broker, S3 endpoint and prefixes, and the jobs' own scoped credentials, so a traced
    task's tracer reports to the same broker; never the platform's secrets), then its own.
    ``trace_spool_dir`` is where traced tasks spool their events unless their job sets
    ``OPML_TRACE_SPOOL_DIR`` (None: the tracer's default, ``~/.opml/trace-spool``; sandboxed, each
    run has a spool of its own instead);
    ``trace_shipper_idle_exit_s`` is how long a trace shipper waits with nothing to ship before it exits.
    ``sandbox`` (``auto``, ``required`` or ``off``), ``sandbox_uid_base`` and ``sandbox_uid_count`` say
    whether and as which users tasks run sandboxed, and ``protected_dirs`` adds the service's own
    folders to those a job's checkpoint folder may not be in (see
    :mod:`~opml_job_orchestrator.executor.sandbox`); :meth:`start` raises FailedPrecondition when the
    sandbox is ``required`` and cannot be had.

    :meth:`launch` starts the tasks one by one, in the order of ``spec.replicas``; if one cannot
    start, the tasks after it are never started (and have no events) and the run fails.
    A task is LOST only through its heartbeat: a process that exits always has an exit code here.
    """

    def __init__(self, *, work_dir: str | os.PathLike[str], host: str = "127.0.0.1",
                 heartbeat_check_interval_s: float = 1.0, cleanup_grace_s: float = 10.0,
                 shutdown_grace_s: float = 10.0, platform_env: Mapping[str, str] | None = None,
                 trace_spool_dir: str | os.PathLike[str] | None = None, trace_shipper_idle_exit_s: float = 60.0,
                 sandbox: str = "auto", sandbox_uid_base: int = DEFAULT_UID_BASE,
                 sandbox_uid_count: int = DEFAULT_UID_COUNT,
                 protected_dirs: Sequence[str | os.PathLike[str]] = (),
                 devices: Sequence[GpuDevice] | None = None) -> None:
        if not isinstance(work_dir, str | os.PathLike) or not str(work_dir):
            raise InvalidArgument("work_dir", f"`work_dir` must be a directory path, but got {work_dir!r}.")
        if not isinstance(host, str) or not host:
            raise InvalidArgument("host", f"`host` must be a non-empty address, but got {host!r}.")
        self._work_dir = Path(work_dir)
        self._host = host
        self._platform_env = dict(platform_env or {})
        if trace_spool_dir is not None:  # under the job's own OPML_TRACE_SPOOL_DIR, if it sets one
            self._platform_env["OPML_TRACE_SPOOL_DIR"] = str(trace_spool_dir)
        self._check_interval_s = check_seconds(heartbeat_check_interval_s, "heartbeat_check_interval_s",
                                               positive=True)
        self._shipper_idle_exit_s = check_seconds(trace_shipper_idle_exit_s, "trace_shipper_idle_exit_s",
                                                  positive=True)
        check_settings(sandbox, sandbox_uid_base, sandbox_uid_count)
        self._sandbox_settings = (sandbox, sandbox_uid_base, sandbox_uid_count, tuple(protected_dirs))
        self._sandbox: Sandbox | None = None
        self._given_devices = devices
        self.devices = DevicePool(devices or ())
        super().__init__(cleanup_grace_s=cleanup_grace_s, shutdown_grace_s=shutdown_grace_s)
        self._watcher: asyncio.Task[None] | None = None
        self._shippers: dict[str, asyncio.subprocess.Process] = {}  # by spool folder ("": the tracer's default)

    @property
    def sandboxed(self) -> bool:
        """Whether tasks run sandboxed (known once started)."""
        return self._sandbox is not None

    async def _open(self) -> None:
        """Create ``work_dir``, set the sandbox up (or find why not), start the heartbeat watcher."""
        self._work_dir.mkdir(parents=True, exist_ok=True)
        if self._given_devices is None:
            self.devices = DevicePool(await asyncio.to_thread(discover))
        mode, uid_base, uid_count, protected = self._sandbox_settings
        self._sandbox = await asyncio.to_thread(Sandbox.open, mode, work_dir=self._work_dir, uid_base=uid_base,
                                                uid_count=uid_count, protected=protected)
        self._watcher = asyncio.create_task(self._watch_heartbeats())

    async def _close(self) -> None:
        """Stop the heartbeat watcher and the trace shippers (what they have not published stays in the spool)."""
        watcher, self._watcher = self._watcher, None
        await cancel_and_wait(watcher)
        shippers, self._shippers = list(self._shippers.values()), {}
        for shipper in shippers:
            with contextlib.suppress(ProcessLookupError):
                shipper.terminate()
        for shipper in shippers:
            try:
                await asyncio.wait_for(shipper.wait(), self._shutdown_grace_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    shipper.kill()
                await shipper.wait()

    async def _launch(self, spec: JobSpec, program: JobProgram, placement: dict[str, tuple[str, ...]], *,
                      attempt: int) -> None:
        run_dir = self._run_dir(spec.job_id, attempt)
        run_dir.mkdir(parents=True, exist_ok=True)
        keys = [(r.role, r.index) for r in spec.replicas]
        jail, unmade = await self._prepare_sandbox(spec.job_id, run_dir, keys, program)
        tasks = {(role, index): _Task((role, index), run_dir / f"{role}-{index}.log",
                                      jail.heartbeat(role, index) if jail else run_dir / f"{role}-{index}.heartbeat")
                 for role, index in keys}
        run = _Run(RunTracker(spec.job_id, attempt, tasks, awaited_tasks(tasks)), placement, tasks,
                   program.heartbeat_timeout_s, sandbox=jail)
        if program.trace:
            run.trace_spool = str(jail.trace_spool) if jail else program.env.get(
                "OPML_TRACE_SPOOL_DIR", self._platform_env.get("OPML_TRACE_SPOOL_DIR", ""))
        self._runs[spec.job_id] = run
        cluster = self._cluster(spec, run.held_ports)
        manifest: dict[str, Any] = {"job_id": spec.job_id, "attempt": attempt, "boot_id": _boot_id(),
                                    "cluster": cluster, "tasks": []}
        launcher_missing = trace_launcher_missing() if program.trace else None
        def record(task: _Task, pid: int) -> None:
            """The task's process exists: into the manifest before it runs the job's program (a
            sandboxed task waits for its config) or at once, so an orchestrator killed mid-launch
            leaves no process its successor's :meth:`recover` cannot find."""
            manifest["tasks"].append(_manifest_entry(task, pid))
            _write_json(run_dir / MANIFEST, manifest)

        gpus = {(r.role, r.index): r.resources.gpu for r in spec.replicas}
        for task in tasks.values():
            failure = (launcher_missing or unmade or self._take_devices(task, gpus[task.key])
                       or await self._spawn(run, task, program, cluster, record))
            if failure is None:
                continue
            event, verdict = run.tracker.could_not_start(task.key, failure)
            task.exited.set()
            self._events.put_nowait(event)
            for unstarted in tasks.values():
                if unstarted.process is None:
                    unstarted.exited.set()
            self._end_soon(run, verdict)
            return

    def _take_devices(self, task: _Task, count: int) -> str | None:
        """Give ``task`` ``count`` free GPUs; return why it cannot have them, or None."""
        role, index = task.key
        try:
            task.devices = self.devices.take(count, who=f"{role} {index}")
        except FailedPrecondition as exc:
            return f"{role} {index} could not start: {exc.message}"
        return None

    async def _prepare_sandbox(self, job_id: str, run_dir: Path, keys: list[TaskKey],
                               program: JobProgram) -> tuple[RunSandbox | None, str | None]:
        """The run's sandbox (None when unsandboxed), or why it could not be made (then no task starts).

        Unsandboxed, a missing checkpoint folder is made as the service's user, who is the job's: a job
        finds its checkpoint folder made whether or not it runs sandboxed."""
        if self._sandbox is None:
            if program.checkpoint_dir is not None:
                try:
                    await asyncio.to_thread(Path(program.checkpoint_dir).mkdir, mode=0o700, parents=True,
                                            exist_ok=True)
                except OSError as exc:
                    return None, f"checkpoint.dir could not be made: {exc.strerror}: {exc.filename!r}"
            return None, None
        try:
            return await asyncio.to_thread(self._sandbox.prepare, job_id, run_dir, keys,
                                           checkpoint_dir=program.checkpoint_dir), None
        except CouldNotStart as exc:
            return None, f"the job's sandbox could not be made: {exc}"
        except OSError as exc:
            return None, f"the job's sandbox could not be made: {exc.strerror}: {exc.filename!r}"

    async def _recover(self, job_id: str, attempt: int) -> Mapping[str, tuple[str, ...]] | None:
        """Stop what run ``attempt`` of ``job_id`` left running (read from its manifest), then
        report the run STOPPED (retriable) and return None, as :meth:`Executor.recover` says.

        A process of the manifest is stopped only if it is still the same process: same boot,
        same start time (``/proc/<pid>/stat``), so a reused pid is never signalled. Its whole
        process group goes, children included, with SIGTERM first so a task can checkpoint, then
        SIGKILL after ``shutdown_grace_s``.
        """
        run_dir = self._run_dir(job_id, attempt)
        boot_id, entries = _read_manifest(run_dir / MANIFEST)
        tasks = {key: _Task(key, Path(log), run_dir / f"{key[0]}-{key[1]}.heartbeat")
                 for key, (_, _, log) in entries.items()}
        run = _Run(RunTracker(job_id, attempt, tasks, ()), {}, tasks, None)
        run.tracker.decide(Verdict(JobOutcome.STOPPED, "recovered after a restart", True))  # terminate() now waits
        for task in tasks.values():
            task.exited.set()
        self._runs[job_id] = run
        groups = {key: (pid, ticks) for key, (pid, ticks, _) in entries.items()} if boot_id == _boot_id() else {}
        left = await _stop_groups(groups, grace_s=self._shutdown_grace_s)
        for key in sorted(left):
            self._events.put_nowait(run.tracker.stopped(key, "left running by a previous executor; stopped"))
        message = (f"recovered after a restart: {len(left)} task(s) left running were stopped" if left
                   else "recovered after a restart: no task of the run was left running")
        self._report_end(run, Verdict(JobOutcome.STOPPED, message, True))
        return None

    async def poll(self, timeout_s: float) -> list[ExecutorEvent]:
        timeout_s = check_seconds(timeout_s, "timeout_s", positive=False)
        events: list[ExecutorEvent] = []
        if self._events.empty():
            with contextlib.suppress(TimeoutError):
                events.append(await asyncio.wait_for(self._events.get(), timeout_s))
        while not self._events.empty():
            events.append(self._events.get_nowait())
        return events

    async def logs(self, job_id: str, role: str, index: int, *, attempt: int | None = None, offset: int = 0) -> str:
        """Read the task's log from ``work_dir`` (from byte ``offset``): runs of earlier executors on it included."""
        offset = check_offset(offset)
        attempts = attempts_logged(self._work_dir / job_id)
        if not attempts:
            raise NotFound(f"job {job_id!r} was never launched on this executor.")
        if attempt is None:
            attempt = attempts[-1]  # every run launched has its folder, whichever executor launched it
        if attempt not in attempts:
            raise NotFound(f"job {job_id!r} has no attempt {attempt!r}; it has {attempts}.")
        path = self._run_dir(job_id, attempt) / f"{role}-{index}.log"
        try:
            return await asyncio.to_thread(read_log, path, offset)
        except FileNotFoundError:
            raise NotFound(f"job {job_id!r} attempt {attempt} has no task {role!r} {index!r}.") from None

    def _run_dir(self, job_id: str, attempt: int) -> Path:
        return self._work_dir / job_id / f"attempt-{attempt}"

    def _cluster(self, spec: JobSpec, held: list[socket.socket]) -> dict[str, list[str]]:
        """TF_CONFIG's ``cluster``: a distinct free port on ``host`` per chief, worker and ps task, each
        held (:func:`~opml_common.ports.hold_free_port`, added to ``held``) until the run ends, so no
        other process takes it while the task starts (seconds of importing TensorFlow before it binds)."""
        cluster: dict[str, list[str]] = {}
        for role in CLUSTER_ROLES:
            if role not in spec.roles:
                continue
            addresses = cluster[role] = []
            for _ in range(spec.roles[role].replicas):
                try:
                    held.append(hold_free_port(self._host))
                except OSError:
                    for taken in held:
                        taken.close()
                    raise
                addresses.append(f"{self._host}:{held[-1].getsockname()[1]}")
        return cluster

    async def _spawn(self, run: _Run, task: _Task, program: JobProgram, cluster: dict[str, list[str]],
                     record: Callable[[_Task, int], None]) -> str | None:
        """Start one task, ``record`` ing its pid as soon as its process exists; return why it could not
        start, or None."""
        role, index = task.key
        env = {**base_env(os.environ), **self._platform_env}
        env.update(task_env(program, job_id=run.job_id, attempt=run.attempt, role=role, index=index,
                            cluster=cluster))
        env.update(program.secret_env)  # straight into the process: the sandbox's config pipe is private too
        env["OPML_HEARTBEAT_FILE"] = str(task.heartbeat_path)
        env[VISIBLE_DEVICES] = ",".join(str(device.index) for device in task.devices)
        if run.sandbox is not None:
            env.update(run.sandbox.task_env(role, index))
        argv = task_argv(program, job_id=run.job_id, role=role, index=index, python=sys.executable,
                         shipped=program.trace)
        try:  # OSError: no command, a full disk; ValueError: a NUL byte in argv or env (a job saved before the rule)
            if run.sandbox is None:
                task.heartbeat_path.write_bytes(b"")  # sandboxed, the sandbox made it, the job's user's
            self._read_heartbeat(run, task)
            if run.trace_spool is not None:
                await self._ensure_shipper(run)
            with task.log_path.open("ab") as log:  # append-only: the task cannot seek back over what it wrote
                task.process = await self._start(run, argv, env, stdout=log,
                                                 cwd=run.sandbox.task_cwd(role, index) if run.sandbox else None,
                                                 created=lambda pid: record(task, pid))
        except CouldNotStart as exc:
            return f"{role} {index} could not start: {exc}"
        except (OSError, ValueError) as exc:
            reason = f"{exc.strerror}: {exc.filename!r}" if getattr(exc, "filename", None) else str(exc)
            return f"{role} {index} could not start: {reason}"
        self._events.put_nowait(run.tracker.started(task.key, f"pid {task.process.pid}"))
        self._in_background(self._wait(run, task))
        return None

    async def _start(self, run: _Run, argv: Sequence[str], env: Mapping[str, str], *, stdout: Any,
                     cwd: str | None, created: Callable[[int], None]) -> asyncio.subprocess.Process:
        """Start ``argv`` in a session of its own: in the run's sandbox, or as this process's user in its
        working directory (``cwd`` is the sandbox's).

        Raises:
            CouldNotStart: sandboxed, the command could not run (why); OSError, ValueError: unsandboxed.
        """
        if run.sandbox is not None:
            assert cwd is not None
            return await run.sandbox.spawn(argv, env, cwd=cwd, stdout=stdout, created=created)
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=stdout, stderr=asyncio.subprocess.STDOUT, env=env,
            start_new_session=True)
        created(process.pid)
        return process

    async def _ensure_shipper(self, run: _Run) -> None:
        """Start the trace shipper of the run's spool folder ("": the tracer's default) with the variables a
        task's tracer gets, unless ours runs (one that found the outlet held by another, or idled out, exits;
        the next traced task tries again); sandboxed, as the job's user, in its sandbox. Forgets the
        shippers that exited."""
        assert run.trace_spool is not None
        spool_dir = run.trace_spool
        self._shippers = {folder: shipper for folder, shipper in self._shippers.items() if shipper.returncode is None}
        if spool_dir in self._shippers:
            return
        env = {**base_env(os.environ), **self._platform_env}
        log_path = self._work_dir / "trace-shipper.log"
        if run.sandbox is not None:
            env.update(run.sandbox.shipper_env())
            log_path = self._run_dir(run.job_id, run.attempt) / "trace-shipper.log"
        elif spool_dir:
            env["OPML_TRACE_SPOOL_DIR"] = spool_dir
        argv = [sys.executable, "-m", TRACE_SHIPPER, "--idle-exit-s", f"{self._shipper_idle_exit_s:g}"]
        with log_path.open("ab") as log:
            self._shippers[spool_dir] = await self._start(run, argv, env, stdout=log,
                                                          cwd=str(MOUNT_POINT) if run.sandbox else None,
                                                          created=lambda pid: None)

    async def _wait(self, run: _Run, task: _Task) -> None:
        """Report the task's exit (after its last heartbeat write), and end the run if that decides it."""
        assert task.process is not None
        code = await task.process.wait()
        _kill_group(task.process.pid, signal.SIGKILL)
        self._read_heartbeat(run, task)
        if run.trace_spool is not None and self.running:  # its last events wait in the spool
            try:
                await self._ensure_shipper(run)
            except (OSError, CouldNotStart):
                logger.exception("could not start the trace shipper of %r; the spool keeps the events",
                                 run.trace_spool)
        event, verdict = run.tracker.exited(task.key, code, how=_describe(code))
        if event is not None:
            self._events.put_nowait(event)
        task.exited.set()
        if verdict is not None:
            await self._end(run, verdict, grace_s=self._cleanup_grace_s)

    async def _stop_tasks(self, run: _Run, grace_s: float) -> None:
        """SIGTERM every task's process group still running, SIGKILL those left after ``grace_s``
        (each task's :meth:`_wait` reports how it ended)."""
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
        for sock in run.held_ports:
            sock.close()
        for task in run.tasks.values():
            self.devices.give_back(task.devices)
            task.devices = ()

    async def _watch_heartbeats(self) -> None:
        """Every ``heartbeat_check_interval_s``: read new heartbeat writes (checkpoint reports) and
        declare LOST the tasks whose heartbeat went stale."""
        while True:
            await asyncio.sleep(self._check_interval_s)
            now = time.time()
            for run in list(self._runs.values()):
                if run.tracker.outcome is not None:
                    continue
                for key in run.tracker.running():
                    task = run.tasks[key]
                    self._read_heartbeat(run, task)
                    timeout_s = run.heartbeat_timeout_s
                    if timeout_s is not None and (silent_s := now - task.beat_at) > timeout_s:
                        self._lose(run, task, f"{key[0]} {key[1]} sent no heartbeat for {silent_s:.1f} s "
                                              f"(heartbeat_timeout_s is {timeout_s:g}) to {task.heartbeat_path}")
                        break

    def _read_heartbeat(self, run: _Run, task: _Task) -> None:
        """Note the time of the task's last heartbeat; if it wrote a new checkpoint step, report it.

        The task owns the file (and, sandboxed, the folder it is in): a link, a FIFO or anything but a
        regular file is no heartbeat, and only its first :data:`MAX_HEARTBEAT_BYTES` are read."""
        try:
            fd = os.open(task.heartbeat_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # missing, or a link
            return
        try:
            stat = os.fstat(fd)
            signature = (stat.st_mtime_ns, stat.st_size)
            if not S_ISREG(stat.st_mode) or signature == task.beat:
                return
            text = os.read(fd, MAX_HEARTBEAT_BYTES).decode("utf-8", errors="replace")
        finally:
            os.close(fd)
        task.beat, task.beat_at = signature, stat.st_mtime
        try:
            step = json.loads(text)["checkpoint_step"]
        except (ValueError, TypeError, KeyError):
            return  # a plain touch, or not a report: a heartbeat all the same
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0 and step not in run.checkpoints:
            run.checkpoints.add(step)
            self._events.put_nowait(CheckpointEvent(run.job_id, run.attempt, step, stat.st_mtime))

    def _lose(self, run: _Run, task: _Task, message: str) -> None:
        """Report ``task`` LOST, kill it, and fail the run."""
        assert task.process is not None
        event, verdict = run.tracker.lost(task.key, message)
        self._events.put_nowait(event)
        _kill_group(task.process.pid, signal.SIGKILL)
        self._end_soon(run, verdict)


def _manifest_entry(task: _Task, pid: int) -> dict[str, Any]:
    return {"role": task.key[0], "index": task.key[1], "pid": pid, "start_ticks": _start_ticks(pid),
            "log": str(task.log_path)}


def _read_manifest(path: Path) -> tuple[str | None, dict[TaskKey, tuple[int, int | None, str]]]:
    """A run manifest's boot id and, per task, ``(pid, start ticks, log path)``; nothing if it is
    missing or unreadable (the run never started a task, or died while writing it)."""
    try:
        manifest = json.loads(path.read_text())
        return manifest["boot_id"], {(t["role"], int(t["index"])): (int(t["pid"]), t["start_ticks"], str(t["log"]))
                                     for t in manifest["tasks"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None, {}


def _write_json(path: Path, value: Any) -> None:
    """Replace ``path`` atomically, so a crash never leaves half a manifest."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(value, indent=1))
    os.replace(partial, path)


def _boot_id() -> str | None:
    """This boot's id: start times are counted from boot, so they only compare within one."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, process group, start time in clock ticks since boot)`` of ``pid``, or None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    return fields[0], int(fields[2]), int(fields[19])


def _start_ticks(pid: int) -> int | None:
    stat = _proc_stat(pid)
    return stat[2] if stat else None


def _group_members(pgid: int, not_before_ticks: int) -> list[int]:
    """Live (non-zombie) processes of group ``pgid`` that started no earlier than its leader did.

    The start-time bound keeps a reused group id from matching: a process of a new group with the
    same id would have to start later, and then its leader (pid ``pgid``) is not the recorded one,
    which the caller checks whenever that leader still exists.
    """
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _proc_stat(int(entry.name))) is not None:
            state, group, ticks = stat
            if group == pgid and state != "Z" and ticks >= not_before_ticks:
                members.append(int(entry.name))
    return members


def _leftovers(groups: Mapping[TaskKey, tuple[int, int | None]]) -> dict[TaskKey, list[int]]:
    """The processes still alive in each task's process group (that is still the task's)."""
    left = {}
    for key, (pgid, ticks) in groups.items():
        if ticks is None:
            continue
        leader = _proc_stat(pgid)
        if leader is not None and leader[2] != ticks:
            continue  # the pid was reused: not ours
        if members := _group_members(pgid, ticks):
            left[key] = members
    return left


async def _stop_groups(groups: Mapping[TaskKey, tuple[int, int | None]], *, grace_s: float) -> set[TaskKey]:
    """SIGTERM every process left in ``groups``, SIGKILL those alive after ``grace_s``; return the
    tasks that had any left."""
    left = await asyncio.to_thread(_leftovers, groups)
    for pids in left.values():
        _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    remaining = left
    while remaining and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        remaining = await asyncio.to_thread(_leftovers, {k: groups[k] for k in remaining})
    for pids in remaining.values():
        _signal_all(pids, signal.SIGKILL)
    return set(left)


def _signal_all(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _kill_group(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the process group ``pid`` leads; a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"
