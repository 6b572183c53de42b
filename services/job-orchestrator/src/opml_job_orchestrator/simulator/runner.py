"""Discrete-event simulation: the real :class:`Scheduler` decides, virtual jobs do the work.

The runner plays the part of the orchestrator's executors and of the jobs themselves. It submits
jobs at their arrival times; executes every decision the scheduler returns (a start plans the
run's checkpoints and its completion; a preemption throws away the progress since the last
checkpoint); reports checkpoints and completions back; and calls ``schedule`` after each instant
at which a job arrived or finished, and at the scheduler's ``next_deadline``.

Job model: a run first pays the job's restart overhead if it resumes after a preemption (a
first start pays none), then makes progress at rate 1, saving a checkpoint every
``checkpoint_interval_s`` of progress; a job without checkpoints restarts from zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from opml_job_orchestrator.scheduler.capacity import Cluster, NodeSpec
from opml_job_orchestrator.scheduler.model import JobClass
from opml_job_orchestrator.scheduler.policies import SchedulingPolicy
from opml_job_orchestrator.scheduler.scheduler import JobRecord, Scheduler, StartJob
from opml_job_orchestrator.simulator.events import Event, EventKind, EventQueue
from opml_job_orchestrator.simulator.workload import SimJob


@dataclass(frozen=True)
class JobOutcome:
    """How one job fared."""

    job_id: str
    job_class: JobClass
    gpus: int
    submit_time: float
    first_start_time: float
    finish_time: float
    duration_s: float
    preemptions: int
    lost_work_s: float
    """Progress thrown away by preemptions (the simulated truth, not the scheduler's estimate)."""
    measured: bool

    @property
    def slowdown(self) -> float:
        """Time from submit to finish over the work itself: 1.0 means it never waited."""
        return (self.finish_time - self.submit_time) / self.duration_s


@dataclass(frozen=True)
class SimulationResult:
    policy: str
    outcomes: tuple[JobOutcome, ...]
    passes: int
    """``schedule`` calls."""
    decisions: int
    """Starts and preemptions the scheduler decided."""


class _VirtualJob:
    """The simulated truth of one job: how much work is saved, and the current run's timing."""

    __slots__ = ("job", "saved_s", "run", "progress_from", "run_base_s", "finish_at", "lost_s")

    def __init__(self, job: SimJob) -> None:
        self.job = job
        self.saved_s = 0.0
        self.run = 0
        self.progress_from = 0.0
        self.run_base_s = 0.0
        self.finish_at = 0.0
        self.lost_s = 0.0

    def progress_at(self, now: float) -> float:
        return self.run_base_s + max(0.0, now - self.progress_from)


def simulate(jobs: Sequence[SimJob], nodes: Sequence[NodeSpec], policy: SchedulingPolicy) -> SimulationResult:
    """Run ``jobs`` on a cluster of ``nodes`` under ``policy`` until every job has finished.

    Deterministic: the same jobs, nodes and policy give the same result.

    Raises:
        InvalidArgument: a job asks for more than the cluster has (from ``Scheduler.submit``).
    """
    scheduler = Scheduler(Cluster(nodes), policy)
    events = EventQueue()
    virtual: dict[str, _VirtualJob] = {}
    for job in jobs:
        virtual[job.spec.job_id] = _VirtualJob(job)
        events.push(Event(job.submit_time, EventKind.ARRIVAL, job.spec.job_id))
    outcomes: list[JobOutcome] = []
    wakeups: set[float] = set()
    passes = decisions = 0
    while events:
        now = events.next_time()
        changed = False
        while events and events.next_time() == now:
            event = events.pop()
            if event.kind is EventKind.WAKEUP:
                wakeups.discard(now)
                changed = True
                continue
            state = virtual[event.job_id]
            if event.kind is EventKind.ARRIVAL:
                scheduler.submit(state.job.spec, now=now)
                changed = True
            elif event.run != state.run:
                continue  # planned for a run that was preempted since
            elif event.kind is EventKind.CHECKPOINT:
                state.saved_s = state.progress_at(now)
                scheduler.record_checkpoint(event.job_id, now=now)
                _plan_checkpoint(events, state, now)
            else:
                record = scheduler.finish(event.job_id, now=now)
                outcomes.append(_outcome(state, record, now))
                changed = True
        if not changed:
            continue  # only checkpoints: nothing frees or needs room
        passes += 1
        for decision in scheduler.schedule(now=now):
            decisions += 1
            if isinstance(decision, StartJob):
                _start(events, virtual[decision.job_id], decision, now)
            else:
                _preempt(virtual[decision.job_id], now)
        deadline = scheduler.next_deadline()
        if deadline is not None and deadline not in wakeups:
            wakeups.add(deadline)
            events.push(Event(deadline, EventKind.WAKEUP))
    outcomes.sort(key=lambda o: o.submit_time)
    return SimulationResult(policy.name, tuple(outcomes), passes, decisions)


def _start(events: EventQueue, state: _VirtualJob, decision: StartJob, now: float) -> None:
    spec = state.job.spec
    state.run += 1
    state.progress_from = now + (spec.restart_overhead_s if decision.resume else 0.0)
    state.run_base_s = state.saved_s
    state.finish_at = state.progress_from + (state.job.duration_s - state.saved_s)
    events.push(Event(state.finish_at, EventKind.FINISH, spec.job_id, state.run))
    _plan_checkpoint(events, state, state.progress_from)


def _plan_checkpoint(events: EventQueue, state: _VirtualJob, after: float) -> None:
    interval = state.job.spec.checkpoint_interval_s
    if interval is not None and after + interval < state.finish_at:
        events.push(Event(after + interval, EventKind.CHECKPOINT, state.job.spec.job_id, state.run))


def _preempt(state: _VirtualJob, now: float) -> None:
    state.lost_s += state.progress_at(now) - state.saved_s
    state.run += 1  # the run's planned checkpoints and completion are void


def _outcome(state: _VirtualJob, record: JobRecord, now: float) -> JobOutcome:
    job, first_start = state.job, record.first_started_at
    return JobOutcome(job_id=job.spec.job_id, job_class=job.spec.job_class, gpus=job.spec.total.gpu,
                      submit_time=job.submit_time, first_start_time=first_start if first_start is not None else now,
                      finish_time=now, duration_s=job.duration_s, preemptions=record.preemptions,
                      lost_work_s=state.lost_s, measured=job.measured)
