"""Executors carry out the scheduler's decisions: they run each role replica of a job as a task.

:class:`Executor` is the interface; :class:`LocalExecutor` runs tasks as local processes (the
embedded default) and ``KubernetesExecutor`` (in ``executor.kubernetes``, imported on demand so
the local path never loads the Kubernetes client) as pods; both follow TonY's rules from
``executor.tony`` and share the run bookkeeping of ``executor.tracked`` (``TrackedRunExecutor``).
:class:`RetryPolicy` decides when a failed run runs again.
"""

from opml_job_orchestrator.executor.base import (
    CheckpointEvent,
    Executor,
    ExecutorEvent,
    JobEvent,
    JobOutcome,
    JobProgram,
    TaskEvent,
    TaskState,
)
from opml_job_orchestrator.executor.local import LocalExecutor
from opml_job_orchestrator.executor.retry import RetryPolicy

__all__ = [
    "CheckpointEvent",
    "Executor",
    "ExecutorEvent",
    "JobEvent",
    "JobOutcome",
    "JobProgram",
    "LocalExecutor",
    "RetryPolicy",
    "TaskEvent",
    "TaskState",
]
