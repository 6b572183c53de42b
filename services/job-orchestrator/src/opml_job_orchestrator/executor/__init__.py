"""Executors carry out the scheduler's decisions: they run each role replica of a job as a task.

:class:`Executor` is the interface (a Kubernetes executor is to come); :class:`LocalExecutor`
runs tasks as local processes; :class:`RetryPolicy` decides when a failed run runs again.
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
