"""TonY's conventions, shared by every executor: what each task is told, and when a run ends.

Every executor gives a task the same environment (TF_CONFIG and ``OPML_*``, :func:`task_env`)
and the same argv (the role's command, under the trace-collector's launcher when the program
asks for tracing, :func:`task_argv`), and reports what it observes of its tasks (a process
exited, a pod's phase changed) to a :class:`RunTracker`. The tracker holds LinkedIn TonY's
completion rules in one place: it says which :class:`~opml_job_orchestrator.executor.base.TaskEvent`
to report and whether the observation decides the run (a :class:`Verdict`). What follows (stop
the tasks still running, report the ``JobEvent``) is the executor's:
:class:`~opml_job_orchestrator.executor.tracked.TrackedRunExecutor` does it once per run.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from opml_job_orchestrator.executor.base import JobOutcome, JobProgram, TaskEvent, TaskState
from opml_trace_collector_contract.names import LAUNCHER_MODULE, SHIPPER_MODULE

CLUSTER_ROLES = ("chief", "worker", "ps")
"""Roles listed in TF_CONFIG's ``cluster``: TensorFlow wants the evaluator left out of it."""

TRACE_LAUNCHER = LAUNCHER_MODULE
"""The trace-collector's launcher: it patches TensorFlow at start-up, then runs the job's argv."""
TRACE_SHIPPER = SHIPPER_MODULE
"""The host's shipper of traced tasks' events (they only write them to the spool); an executor whose tasks
run on its own machine keeps one as its child, the launcher starts one elsewhere (a pod)."""

TaskKey = tuple[str, int]
"""``(role, index)`` of one task."""


def tf_config(cluster: Mapping[str, Sequence[str]], role: str, index: int) -> str:
    """TF_CONFIG for task ``role``/``index`` of a run whose chief, worker and ps addresses are ``cluster``."""
    return json.dumps({"cluster": {r: list(a) for r, a in cluster.items()}, "task": {"type": role, "index": index}})


INHERITED_VARIABLES = frozenset({"PATH", "HOME", "LANG", "TZ"})
"""What a local task takes from the service's environment, with every ``LC_*``: nothing else (no
token, key or URL of the platform's), whatever the service was started with."""



def base_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The allow-listed part of ``environ`` (:data:`INHERITED_VARIABLES` and ``LC_*``) a local task starts from."""
    return {k: v for k, v in environ.items() if k in INHERITED_VARIABLES or k.startswith("LC_")}


def task_env(program: JobProgram, *, job_id: str, attempt: int, role: str, index: int,
             cluster: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """The variables every executor sets for one task, on top of ``program.env`` (not its secret env,
    which each executor hands over its own private way)."""
    env = dict(program.env)
    env.update({
        "TF_CONFIG": tf_config(cluster, role, index),
        "OPML_JOB_ID": job_id,
        "OPML_JOB_ATTEMPT": str(attempt),
        "OPML_TASK_TYPE": role,
        "OPML_TASK_INDEX": str(index),
    })
    if program.checkpoint_dir is not None:
        env["OPML_CHECKPOINT_DIR"] = program.checkpoint_dir
    return env


def task_argv(program: JobProgram, *, job_id: str, role: str, index: int, python: str,
              shipped: bool = False) -> list[str]:
    """The role's command; with ``program.trace``, run by ``python -m`` the trace launcher, unchanged.

    The launcher names the trace after the job and the task (``worker-1``), so the job's code
    needs no change to be traced. ``shipped``: the executor runs the host's shipper itself, so the
    launcher starts none (``--no-shipper``).
    """
    argv = list(program.commands[role])
    if not program.trace:
        return argv
    own = ["--no-shipper"] if shipped else []
    return [python, "-m", TRACE_LAUNCHER, *own, "--job", job_id, "--worker", f"{role}-{index}", "--", *argv]


def trace_launcher_missing() -> str | None:
    """Why this Python cannot run traced tasks, or None when the trace launcher is installed."""
    try:
        found = importlib.util.find_spec(TRACE_LAUNCHER) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    if found:
        return None
    return (f"tracing is on (`trace`), but the trace launcher {TRACE_LAUNCHER!r} is not installed here; "
            "install opml-trace-collector beside the job orchestrator, or submit the job with trace off")


def awaited_tasks(tasks: Iterable[TaskKey]) -> frozenset[TaskKey]:
    """Of a run's ``tasks``, those whose exit 0 makes it succeed: the chief; with no chief, every
    worker; with neither, every task but the parameter servers."""
    tasks = list(tasks)
    for role in ("chief", "worker"):
        if any(r == role for r, _ in tasks):
            return frozenset(k for k in tasks if k[0] == role)
    return frozenset(k for k in tasks if k[0] != "ps")


class Verdict(NamedTuple):
    """How an observation ended a run: the ``JobEvent``'s ``outcome``, ``message`` and ``retriable``."""

    outcome: JobOutcome
    message: str
    retriable: bool


class RunTracker:
    """TonY's rules for one run: turns observations of its tasks into task events and a verdict.

    Pure (no I/O, no clock), so every executor and its tests share it. A run succeeds when every
    awaited task (:func:`awaited_tasks`) exited 0, without waiting for parameter servers; it fails
    at the first task that fails, cannot start, or is lost. Once decided, :attr:`outcome` is set
    and tasks that end afterwards are STOPPED: the executor stopped them.
    """

    def __init__(self, job_id: str, attempt: int, tasks: Iterable[TaskKey], awaited: Iterable[TaskKey]) -> None:
        self.job_id = job_id
        self.attempt = attempt
        self.states: dict[TaskKey, TaskState | None] = dict.fromkeys(tasks)
        """Each task's last reported state; None while it has not started."""
        self.awaited = frozenset(awaited)
        self.outcome: JobOutcome | None = None

    def running(self) -> list[TaskKey]:
        """The tasks reported RUNNING and not yet ended."""
        return [key for key, state in self.states.items() if state is TaskState.RUNNING]

    def decide(self, verdict: Verdict) -> bool:
        """Set the run's outcome unless it is already decided; True if this call decided it."""
        if self.outcome is not None:
            return False
        self.outcome = verdict.outcome
        return True

    def started(self, key: TaskKey, message: str = "") -> TaskEvent:
        self.states[key] = TaskState.RUNNING
        return self._event(key, TaskState.RUNNING, message=message)

    def could_not_start(self, key: TaskKey, message: str, *, retriable: bool = False) -> tuple[TaskEvent, Verdict]:
        """The task never ran (no such command, an invalid manifest): the run fails."""
        self.states[key] = TaskState.FAILED
        return self._event(key, TaskState.FAILED, message=message), Verdict(JobOutcome.FAILED, message, retriable)

    def exited(self, key: TaskKey, exit_code: int | None, *, how: str) -> tuple[TaskEvent | None, Verdict | None]:
        """The task ended with ``exit_code`` (``how`` says it for people: ``exited with code 3``);
        None when it failed without one (a pod the kubelet could not run).

        Returns no event for a task already reported LOST (its end was reported then).
        """
        if self.states.get(key) is TaskState.LOST:
            return None, None
        role, index = key
        if self.outcome is not None:
            state, message, verdict = TaskState.STOPPED, f"stopped, {how}", None
        elif exit_code == 0:
            state, message, verdict = TaskState.SUCCEEDED, how, None
            if key in self.awaited and all(self.states[k] is TaskState.SUCCEEDED for k in self.awaited - {key}):
                names = ", ".join(f"{r} {i}" for r, i in sorted(self.awaited))
                verdict = Verdict(JobOutcome.SUCCEEDED, f"{names} exited with code 0", False)
        else:
            state = TaskState.FAILED
            message = f"{role} {index} {how}"
            verdict = Verdict(JobOutcome.FAILED, message, True)
        self.states[key] = state
        return self._event(key, state, exit_code=exit_code, message=message), verdict

    def lost(self, key: TaskKey, message: str) -> tuple[TaskEvent, Verdict]:
        """The task stopped answering (stale heartbeat, a pod that vanished or whose node died)."""
        self.states[key] = TaskState.LOST
        return self._event(key, TaskState.LOST, message=message), Verdict(JobOutcome.FAILED, message, True)

    def stopped(self, key: TaskKey, message: str, exit_code: int | None = None) -> TaskEvent:
        """The executor stopped the task (it ends without an exit code the executor could read)."""
        self.states[key] = TaskState.STOPPED
        return self._event(key, TaskState.STOPPED, exit_code=exit_code, message=message)

    def _event(self, key: TaskKey, state: TaskState, *, exit_code: int | None = None, message: str = "") -> TaskEvent:
        return TaskEvent(self.job_id, self.attempt, key[0], key[1], state, exit_code, message)
