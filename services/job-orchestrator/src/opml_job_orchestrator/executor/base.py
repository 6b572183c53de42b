"""The executor interface: it carries out the scheduler's decisions on real machines.

An executor runs each replica of each role of a job as one *task* (a local process, or a
Kubernetes pod), and reports what happens to the tasks as events. It decides nothing about
order, preemption or retries: the orchestrator loop asks the
:class:`~opml_job_orchestrator.scheduler.scheduler.Scheduler` what to do, calls :meth:`Executor.launch`
for a ``StartJob`` and :meth:`Executor.terminate` for a ``PreemptJob`` or a cancel, and feeds the
events from :meth:`Executor.poll` back (a ``JobEvent`` ends a run: ``finish``, or a retry decided
by :class:`~opml_job_orchestrator.executor.retry.RetryPolicy`).

A run ends like one of LinkedIn's TonY: it succeeds when the chief exits 0 (or, with no chief,
when every worker has), without waiting for parameter servers, which never exit on their own; it
fails as soon as any task fails, cannot start, or is lost. Either way the executor then stops
the tasks still running and only then reports the ``JobEvent``, so resources are free when the
orchestrator hears of it.
"""

from __future__ import annotations

import abc
import enum
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from opml_common.errors import FailedPrecondition, InvalidArgument
from opml_common.lifecycle import Component
from opml_job_orchestrator.scheduler.model import ROLE_NAMES, JobSpec

# The executors check a placement as the scheduler does when it adopts a run.
from opml_job_orchestrator.scheduler.scheduler import check_placement as check_placement


class TaskState(enum.Enum):
    """Where one task (one replica of one role) of a run stands."""

    RUNNING = "running"
    """It started."""
    SUCCEEDED = "succeeded"
    """It exited with code 0."""
    FAILED = "failed"
    """It exited with another code, was killed by a signal it was not sent by the executor, or
    could not start (the event's message says why: ``No such file or directory: 'nosuchcmd'``)."""
    LOST = "lost"
    """It stopped answering: its heartbeat went stale, or it vanished without an exit code."""
    STOPPED = "stopped"
    """The executor stopped it: the run was terminated, or ended while the task still ran."""


class JobOutcome(enum.Enum):
    """How one run of a job ended."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    """:meth:`Executor.terminate` (a preemption, a cancel, or the executor's own stop) ended it."""


@dataclass(frozen=True, slots=True)
class TaskEvent:
    """Task ``role``/``index`` of run ``attempt`` of ``job_id`` reached ``state``.

    ``exit_code`` is the process's code once it exited (negative: killed by that signal), else
    None; ``message`` says what happened, for people.
    """

    job_id: str
    attempt: int
    role: str
    index: int
    state: TaskState
    exit_code: int | None = None
    message: str = ""


@dataclass(frozen=True, slots=True)
class JobEvent:
    """Run ``attempt`` of ``job_id`` ended with ``outcome``; none of its tasks runs any more.

    ``retriable`` says whether running it again may help (a crash or a lost task: yes; a command
    that does not exist: no); retry loops test the flag, not the message.
    """

    job_id: str
    attempt: int
    outcome: JobOutcome
    message: str = ""
    retriable: bool = False


@dataclass(frozen=True, slots=True)
class CheckpointEvent:
    """Run ``attempt`` of ``job_id`` saved a checkpoint of ``step`` at ``at`` (epoch seconds).

    A task reports it by writing ``{"checkpoint_step": N}`` (JSON) to the file named by
    ``OPML_HEARTBEAT_FILE``; the orchestrator feeds it to ``Scheduler.record_checkpoint`` so the
    preemption policy knows how little work stopping the job now would lose.
    """

    job_id: str
    attempt: int
    step: int
    at: float


ExecutorEvent = TaskEvent | JobEvent | CheckpointEvent


@dataclass(frozen=True)
class JobProgram:
    """What each task of a job runs, beside the scheduler's :class:`JobSpec`.

    ``commands`` maps each role of the spec to its argv (any program: TF_CONFIG is an environment
    variable, no TensorFlow is needed). ``env`` is added to every task's environment, and so is
    ``secret_env``, whose values are secrets: kept out of this object's repr, and handed to tasks
    privately (the local executor in the process's environment, the Kubernetes one through a Secret
    of the run, never in a pod spec).
    ``checkpoint_dir``, when set, is passed as ``OPML_CHECKPOINT_DIR`` so a resumed run finds its
    checkpoint. ``heartbeat_timeout_s``, when set, makes the executor declare a task LOST once
    it has not touched the file named by ``OPML_HEARTBEAT_FILE`` for that long (None: no
    heartbeat is watched). ``trace`` runs every task under the trace-collector's launcher
    (``python -m opml_trace_collector.inject.run --job J --worker ROLE-INDEX -- ARGV``), which
    traces its TensorFlow with no change to the job's code.
    """

    commands: Mapping[str, Sequence[str]]
    env: Mapping[str, str] = field(default_factory=dict)
    secret_env: Mapping[str, str] = field(default_factory=dict, repr=False)
    checkpoint_dir: str | None = None
    heartbeat_timeout_s: float | None = None
    trace: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.commands, Mapping) or not self.commands:
            raise InvalidArgument("commands", f"`commands` must map roles to argv lists, but got {self.commands!r}.")
        commands: dict[str, tuple[str, ...]] = {}
        for role, argv in self.commands.items():
            if role not in ROLE_NAMES:
                raise InvalidArgument(f"commands.{role}", f"role {role!r} is not one of {list(ROLE_NAMES)}.")
            if (isinstance(argv, str) or not isinstance(argv, Sequence) or not argv
                    or not all(isinstance(arg, str) for arg in argv)):
                raise InvalidArgument(f"commands.{role}", f"`commands.{role}` must be a non-empty list of "
                                                          f"strings (an argv), but got {argv!r}.")
            commands[role] = tuple(argv)
        object.__setattr__(self, "commands", MappingProxyType(commands))
        if not isinstance(self.env, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise InvalidArgument("env", f"`env` must map strings to strings, but got {self.env!r}.")
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))
        if not isinstance(self.secret_env, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.secret_env.items()):
            raise InvalidArgument("secret_env", "`secret_env` must map strings to strings (values not shown).")
        object.__setattr__(self, "secret_env", MappingProxyType(dict(self.secret_env)))
        if self.checkpoint_dir is not None and (not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir):
            raise InvalidArgument("checkpoint_dir", "`checkpoint_dir` must be a non-empty path or None, "
                                                    f"but got {self.checkpoint_dir!r}.")
        if self.heartbeat_timeout_s is not None:
            check_seconds(self.heartbeat_timeout_s, "heartbeat_timeout_s", positive=True,
                          hint=", or None for no heartbeat")
        if not isinstance(self.trace, bool):
            raise InvalidArgument("trace", f"`trace` must be true or false, but got {self.trace!r}.")

    def check_covers(self, spec: JobSpec) -> None:
        """Raise InvalidArgument unless there is a command for every role of ``spec``."""
        for role in spec.roles:
            if role not in self.commands:
                raise InvalidArgument(f"commands.{role}", f"job {spec.job_id!r} has role {role!r} but `commands` "
                                                          f"has no entry for it; it has {sorted(self.commands)}.")


class Executor(Component, abc.ABC):
    """Runs the tasks of jobs and reports what happens to them.

    A :class:`~opml_common.lifecycle.Component`: ``async with executor:`` or :meth:`start` /
    :meth:`stop`, both idempotent, and started again after a stop. All methods are called from one
    asyncio event loop.
    """

    adoptable = False
    """Whether another orchestrator's :meth:`recover` re-adopts this one's runs where they run (pods):
    then a replica that stops leading leaves them going (:meth:`release`) for its successor."""

    async def release(self) -> None:
        """Stop, leaving every run going, untracked: only for an :attr:`adoptable` executor.

        Raises:
            FailedPrecondition: this executor's runs cannot be adopted elsewhere.
        """
        raise FailedPrecondition(f"{type(self).__name__}'s runs cannot be adopted by another orchestrator")

    async def on_start(self) -> None:
        """Get ready to launch: the orchestrator starts the executor before its first :meth:`launch`.

        Side effects are the implementation's (the local executor creates its work directory and
        starts its heartbeat watcher).
        """

    async def on_stop(self) -> None:
        """Terminate every run still going and release everything: called at orchestrator shutdown.

        Each run still going ends with a ``JobEvent`` of outcome STOPPED, still readable with :meth:`poll`.
        """

    @abc.abstractmethod
    async def launch(self, spec: JobSpec, program: JobProgram, placement: Mapping[str, Sequence[str]], *,
                     attempt: int) -> None:
        """Start run ``attempt`` of a job: called for each ``StartJob`` decision, and for a retry.

        Starts one task per replica of every role, on the nodes of ``placement`` (the
        ``StartJob.placement``), each with TF_CONFIG for its role and index and with
        ``OPML_JOB_ATTEMPT`` = ``attempt`` (0 for the first run, n for the n-th retry or resume).
        Returns once every task was started or failed to start; what happens to the tasks
        afterwards (failing to start included) arrives through :meth:`poll`.

        Raises:
            InvalidArgument: ``attempt`` is not an integer >= 0, ``program`` has no command for a
                role of ``spec``, or ``placement`` does not name one node per replica.
            FailedPrecondition: the executor is not started, or a run of this job still goes.
        """

    @abc.abstractmethod
    async def terminate(self, job_id: str, grace_s: float) -> None:
        """Stop the current run of ``job_id``: called for a ``PreemptJob`` decision or a cancel.

        Sends every task SIGTERM (so a preempted BE job can write a checkpoint), waits up to
        ``grace_s`` seconds, then kills what still runs, children included. Returns once no task
        runs; the run then ends with a ``JobEvent`` of outcome STOPPED, unless it had already
        ended, in which case this does nothing.

        Raises:
            InvalidArgument: ``grace_s`` is not a finite number >= 0.
            NotFound: ``job_id`` was never launched.
        """

    @abc.abstractmethod
    async def recover(self, job_id: str, attempt: int) -> Mapping[str, tuple[str, ...]] | None:
        """Take over run ``attempt`` of ``job_id`` from an executor that ran before a restart.

        Called by a restarted orchestrator for each run its durable state says was going, before
        it launches anything, so that a retry never runs beside a leftover of the same job. Once
        it returns, this executor owns the run: :meth:`terminate` and :meth:`logs` know it, and
        :meth:`poll` reports how it ends with one ``JobEvent``. An executor whose tasks outlive it
        (Kubernetes pods) re-adopts them and the run goes on: it returns the run's placement,
        where its tasks really are (role -> node of each replica, as ``StartJob.placement``), so
        the scheduler can count them there (``Scheduler.adopt``). One that cannot watch tasks it
        did not start (local processes) stops them (SIGTERM, a grace, then a kill), reports the
        run STOPPED with ``retriable`` true, so the orchestrator runs it again from its
        checkpoint, and returns None. A run of which nothing is left is reported the same way.
        Calling it for the run this executor already tracks changes nothing and returns its
        placement (None once it ended).

        Raises:
            InvalidArgument: ``attempt`` is not an integer >= 0.
            FailedPrecondition: the executor is not started, or another run of the job still goes.
        """

    @abc.abstractmethod
    async def poll(self, timeout_s: float) -> list[ExecutorEvent]:
        """Return the events since the last call, oldest first: called by the orchestrator loop.

        Waits up to ``timeout_s`` seconds for a first event (the loop passes the time until the
        scheduler's ``next_deadline()``), then returns all that are ready; an empty list means
        nothing happened. A run's task events and checkpoint events come before its
        ``JobEvent``; a ``CheckpointEvent`` comes once per new step a run reports.

        Raises:
            InvalidArgument: ``timeout_s`` is not a finite number >= 0.
        """

    @abc.abstractmethod
    async def logs(self, job_id: str, role: str, index: int, *, attempt: int | None = None, offset: int = 0) -> str:
        """Return what task ``role``/``index`` of a run wrote to stdout and stderr so far, from
        byte ``offset`` of the log on (a follower passes what it has read, and reads only new output).

        Called for users (a CLI, the API) at any time, during or after the run. ``attempt``
        None means the latest run. The bytes are decoded as UTF-8 with ``surrogateescape``, so
        ``text.encode("utf-8", "surrogateescape")`` gives them back exactly, even a character cut
        in two by the end of the read: its length is what to add to ``offset`` for the next read.

        Raises:
            InvalidArgument: ``offset`` is not an integer >= 0.
            NotFound: the job, that run of it, or that task does not exist.
        """



def check_seconds(value: Any, field: str, *, positive: bool, hint: str = "") -> float:
    """Return ``value`` if it is a finite number of seconds (> 0 with ``positive``, else >= 0).

    Raises:
        InvalidArgument: it is not; the message names ``field``, shows the value and the rule.
    """
    bound = "> 0" if positive else ">= 0"
    if (not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value)
            or value < 0 or (positive and value == 0)):
        raise InvalidArgument(field, f"`{field}` must be a finite number of seconds {bound}{hint}, but got {value!r}.")
    return float(value)


def check_attempt(attempt: Any) -> int:
    """Return ``attempt`` if it is an integer >= 0.

    Raises:
        InvalidArgument: it is not.
    """
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
        raise InvalidArgument("attempt", f"`attempt` must be an integer >= 0, but got {attempt!r}.")
    return attempt


def check_offset(offset: Any) -> int:
    """Return ``offset`` if it is an integer >= 0.

    Raises:
        InvalidArgument: it is not.
    """
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise InvalidArgument("offset", f"`offset` must be an integer >= 0 (bytes), but got {offset!r}.")
    return offset


def read_log(path: Path, offset: int) -> str:
    """A log file from byte ``offset`` on, as :meth:`Executor.logs` returns it (blocking: run it in a thread).

    Raises:
        FileNotFoundError: there is no such log.
    """
    with path.open("rb") as log:
        log.seek(offset)
        return log.read().decode("utf-8", "surrogateescape")


_ATTEMPT_DIR = re.compile(r"attempt-(\d+)")


def attempts_logged(job_dir: Path) -> list[int]:
    """The attempts that have an ``attempt-{n}`` folder of logs in ``job_dir``, in order."""
    if not job_dir.is_dir():
        return []
    return sorted(int(m[1]) for p in job_dir.iterdir() if (m := _ATTEMPT_DIR.fullmatch(p.name)))
