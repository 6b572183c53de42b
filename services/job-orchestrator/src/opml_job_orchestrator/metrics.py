"""The orchestrator's Prometheus metrics: jobs by state, waits, preemptions, retries, decision latency.

:class:`JobMetrics` counts each lifecycle event the :class:`~opml_job_orchestrator.recorder.JobRecorder`
hands it; :class:`TimedScheduler` wraps the scheduler's ``schedule`` call to time each decision
pass (a wrapper, not a flag in the core).
"""

from __future__ import annotations

import time

from opml_common.metrics import ServiceMetrics
from opml_job_orchestrator.orchestrator import EventKind, JobState, JobStatus, LifecycleEvent
from opml_job_orchestrator.scheduler.capacity import Cluster
from opml_job_orchestrator.scheduler.model import JobClass
from opml_job_orchestrator.scheduler.policies import SchedulingPolicy
from opml_job_orchestrator.scheduler.scheduler import Decision, Scheduler

WAIT_BUCKETS = (0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600)
_QUEUEING = {EventKind.SUBMITTED, EventKind.PREEMPTED, EventKind.RETRYING}
_STARTING = {EventKind.STARTED, EventKind.RESUMED}


class JobMetrics:
    """``opml_job_orchestrator_jobs{state,job_class}``, ``..._job_wait_seconds{job_class}`` (from
    entering the queue, by a submit, a preemption or a failure, to the run's start),
    ``..._preemptions_total{job_class}`` and ``..._retries_total{job_class}``."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self._jobs = metrics.gauge("jobs", "Jobs known to the orchestrator, by state and class.",
                                   ("state", "job_class"))
        self._wait = metrics.histogram("job_wait_seconds", "Time from entering the queue to the run's start.",
                                       ("job_class",), buckets=WAIT_BUCKETS)
        self._preemptions = metrics.counter("preemptions_total", "Runs stopped to make room or by an admin.",
                                            ("job_class",))
        self._retries = metrics.counter("retries_total", "Failed runs queued to run again.", ("job_class",))
        self._states: dict[str, JobState] = {}
        self._classes: dict[str, JobClass] = {}
        self._queued_at: dict[str, float] = {}

    def seed(self, status: JobStatus, job_class: JobClass) -> None:
        """Count a job restored after a restart."""
        self._move(status.job_id, status.state, job_class)

    def forget(self) -> None:
        """Count no job any more (this replica stopped leading: the jobs are its successor's to count)."""
        for job_id, state in self._states.items():
            self._jobs.labels(state.value, self._classes[job_id].name).dec()
        self._states.clear()
        self._classes.clear()
        self._queued_at.clear()

    def observe(self, event: LifecycleEvent, job_class: JobClass) -> None:
        label = job_class.name
        if event.kind in _QUEUEING:
            self._queued_at[event.job_id] = event.at
        elif event.kind in _STARTING and event.job_id in self._queued_at:
            self._wait.labels(label).observe(max(0.0, event.at - self._queued_at.pop(event.job_id)))
        if event.kind is EventKind.PREEMPTED:
            self._preemptions.labels(label).inc()
        elif event.kind is EventKind.RETRYING:
            self._retries.labels(label).inc()
        self._move(event.job_id, event.state, job_class)

    def _move(self, job_id: str, state: JobState, job_class: JobClass) -> None:
        previous = self._states.get(job_id)
        if previous is state:
            return
        if previous is not None:
            self._jobs.labels(previous.value, job_class.name).dec()
        self._jobs.labels(state.value, job_class.name).inc()
        self._states[job_id] = state
        self._classes[job_id] = job_class


class TimedScheduler(Scheduler):
    """A :class:`Scheduler` whose every ``schedule`` pass is timed into
    ``opml_job_orchestrator_scheduling_decision_seconds``."""

    def __init__(self, cluster: Cluster, policy: SchedulingPolicy, metrics: ServiceMetrics) -> None:
        super().__init__(cluster, policy)
        self._latency = metrics.histogram("scheduling_decision_seconds", "Duration of one scheduling pass.")

    def schedule(self, *, now: float) -> list[Decision]:
        started = time.perf_counter()
        try:
            return super().schedule(now=now)
        finally:
            self._latency.observe(time.perf_counter() - started)
