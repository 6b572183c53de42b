"""The orchestrator loop: it joins the scheduler, which decides, and an executor, which runs jobs.

:class:`Orchestrator` imports no transport. The gRPC servicer to come calls :meth:`Orchestrator.submit`,
:meth:`~Orchestrator.cancel`, :meth:`~Orchestrator.preempt`, :meth:`~Orchestrator.get` and
:meth:`~Orchestrator.list`; a Kafka publisher to come is a :data:`LifecycleListener` that receives
every :class:`LifecycleEvent`.

One loop task, in steps: resubmit the jobs whose retry delay is over, call ``Scheduler.schedule``
and carry out its decisions in order (``Executor.terminate`` for a ``PreemptJob``, then
``Executor.launch`` for a ``StartJob``), then wait for ``Executor.poll`` until the scheduler's
``next_deadline()`` or the next retry, or until a submit or cancel wakes it. A ``JobEvent`` ends a
run: success finishes the job in the scheduler; a failure frees its room and, if the
:class:`~opml_job_orchestrator.executor.retry.RetryPolicy` gives a delay (it tests the event's
``retriable``), queues it again after that delay, else fails it with the event's message as cause.

Each run has its own ``attempt`` (``OPML_JOB_ATTEMPT``): 0 first, then one more for every retry and
every resume after a preemption, so a resumed run knows to load its checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

from opml_common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, OpmlError

from opml_job_orchestrator.executor.base import Executor, ExecutorEvent, JobEvent, JobOutcome, JobProgram, check_seconds
from opml_job_orchestrator.executor.retry import RetryPolicy
from opml_job_orchestrator.scheduler.model import JobSpec
from opml_job_orchestrator.scheduler.scheduler import PreemptJob, Scheduler, StartJob

logger = logging.getLogger(__name__)


class JobState(enum.Enum):
    """Where a job stands, as users see it."""

    PENDING = "pending"
    """Queued, never started yet."""
    RUNNING = "running"
    """A run is going."""
    PREEMPTED = "preempted"
    """Stopped to make room (or by an administrator); queued to resume from its checkpoint."""
    RETRYING = "retrying"
    """A run failed; waiting for the retry delay, then queued to run again."""
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


class EventKind(enum.Enum):
    SUBMITTED = "submitted"
    STARTED = "started"
    """A run started: the first one, or one after a failure (``attempt`` says which)."""
    PREEMPTED = "preempted"
    RESUMED = "resumed"
    """A run started again after a preemption."""
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class JobStatus:
    """A snapshot of one job. Times are Unix seconds; ``started_at`` is the first run's start.

    ``attempt`` is the current (or last) run's number, -1 before the first run; ``retries`` counts
    runs that failed and were retried; ``cause`` says why the job last stopped (a failure's message,
    a preemption, a cancel), None while nothing stopped it.
    """

    job_id: str
    state: JobState
    attempt: int
    retries: int
    preemptions: int
    cause: str | None
    submitted_at: float
    started_at: float | None
    updated_at: float
    ended_at: float | None


@dataclass(frozen=True, slots=True)
class LifecycleEvent:
    """``job_id`` went through ``kind`` at ``at`` (Unix seconds), in run ``attempt``, now in ``state``."""

    kind: EventKind
    job_id: str
    attempt: int
    state: JobState
    at: float
    message: str = ""


LifecycleListener = Callable[[LifecycleEvent], None]
"""Called in the loop, in order, for every :class:`LifecycleEvent`. It must not block: a publisher
queues the event and sends it from its own task. What it raises is logged and dropped."""


class _Job:
    __slots__ = ("spec", "program", "state", "attempt", "retries", "preemptions", "cause", "submitted_at",
                 "started_at", "updated_at", "ended_at", "retry_at")

    def __init__(self, spec: JobSpec, program: JobProgram, now: float) -> None:
        self.spec = spec
        self.program = program
        self.state = JobState.PENDING
        self.attempt = -1
        self.retries = 0
        self.preemptions = 0
        self.cause: str | None = None
        self.submitted_at = now
        self.started_at: float | None = None
        self.updated_at = now
        self.ended_at: float | None = None
        self.retry_at: float | None = None
        """Monotonic time to queue a RETRYING job again; None once queued."""

    def status(self) -> JobStatus:
        return JobStatus(self.spec.job_id, self.state, self.attempt, self.retries, self.preemptions, self.cause,
                         self.submitted_at, self.started_at, self.updated_at, self.ended_at)


class Orchestrator:
    """Runs submitted jobs on ``executor`` in the order and places ``scheduler`` decides.

    Keyword-only settings, checked here: ``scheduler`` (the orchestrator is its only caller from
    now on), ``executor`` (the orchestrator starts and stops it), ``retry_policy`` for failed runs,
    ``listeners`` for lifecycle events, ``terminate_grace_s`` between SIGTERM and the kill when a
    run is preempted or cancelled (time for a BE job to write its checkpoint), and ``max_wait_s``,
    the longest the loop waits for executor events before it schedules again.

    Every method is called from the event loop the orchestrator was started in. State lives in
    memory only: a restarted orchestrator knows no job.
    """

    def __init__(self, *, scheduler: Scheduler, executor: Executor, retry_policy: RetryPolicy,
                 listeners: Sequence[LifecycleListener] = (), terminate_grace_s: float = 30.0,
                 max_wait_s: float = 1.0) -> None:
        if not isinstance(scheduler, Scheduler):
            raise InvalidArgument("scheduler", f"`scheduler` must be a Scheduler, but got {scheduler!r}.")
        if not isinstance(executor, Executor):
            raise InvalidArgument("executor", f"`executor` must be an Executor, but got {executor!r}.")
        if not isinstance(retry_policy, RetryPolicy):
            raise InvalidArgument("retry_policy", f"`retry_policy` must be a RetryPolicy, but got {retry_policy!r}.")
        if isinstance(listeners, str) or not isinstance(listeners, Sequence) or not all(map(callable, listeners)):
            raise InvalidArgument("listeners", f"`listeners` must be a list of callables, but got {listeners!r}.")
        self._scheduler = scheduler
        self._executor = executor
        self._retry_policy = retry_policy
        self._listeners = tuple(listeners)
        self._grace_s = check_seconds(terminate_grace_s, "terminate_grace_s", positive=False)
        self._max_wait_s = check_seconds(max_wait_s, "max_wait_s", positive=True)
        self._jobs: dict[str, _Job] = {}
        self._lock = asyncio.Lock()
        """Held while the loop acts on the scheduler and executor, and by cancel and preempt."""
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the executor, then the loop task. Idempotent.

        Jobs submitted before, or preempted by a previous :meth:`stop`, start from the first step.
        """
        if self._loop_task is not None:
            return
        await self._executor.start()
        self._loop_task = asyncio.create_task(self._loop(), name="job-orchestrator-loop")

    async def stop(self) -> None:
        """Stop the loop task, then the executor: every run still going gets SIGTERM, then a kill
        after the executor's grace. Those jobs go back to the queue as PREEMPTED (a later
        :meth:`start` resumes them); jobs waiting stay queued. Idempotent.

        Raises:
            Whatever ended the loop task, if it died of an error (a bug): it is logged as well.
        """
        task, self._loop_task = self._loop_task, None
        if task is None:
            return
        try:
            async with self._lock:  # never cancel the loop halfway through a terminate or a launch
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        finally:
            await self._executor.stop()
            for job in [j for j in self._jobs.values() if j.state is JobState.RUNNING]:
                self._requeue(job, "the orchestrator stopped")

    async def __aenter__(self) -> Orchestrator:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    # -- requests ------------------------------------------------------------------------------

    def submit(self, spec: JobSpec, program: JobProgram) -> str:
        """Queue ``spec`` to run ``program``; return its job id. It starts at the loop's next step.

        Raises:
            InvalidArgument: ``spec`` or ``program`` is of the wrong type, ``program`` has no command
                for a role of ``spec``, or the scheduler rejects the spec (bigger than the cluster:
                the field path names what).
            AlreadyExists: a job with this id was submitted before (ids are never reused: logs and
                checkpoints are kept under them).
        """
        if not isinstance(spec, JobSpec):
            raise InvalidArgument("spec", f"`spec` must be a JobSpec, but got {spec!r}.")
        if not isinstance(program, JobProgram):
            raise InvalidArgument("program", f"`program` must be a JobProgram, but got {program!r}.")
        if spec.job_id in self._jobs:
            raise AlreadyExists(f"job {spec.job_id!r} was already submitted (it is "
                                f"{self._jobs[spec.job_id].state.value}); pick another job_id.")
        program.check_covers(spec)
        self._scheduler.submit(spec, now=time.monotonic())
        job = self._jobs[spec.job_id] = _Job(spec, program, time.time())
        self._emit(job, EventKind.SUBMITTED, f"{spec.job_class.name} job, priority {spec.priority}")
        self._wake.set()
        return spec.job_id

    async def cancel(self, job_id: str) -> JobStatus:
        """Cancel a job that has not ended: drop it from the queue, or stop its run (SIGTERM, then a
        kill after ``terminate_grace_s``), and return its status, CANCELLED.

        Raises:
            NotFound: no job has this id.
            FailedPrecondition: the job already ended (succeeded, failed or was cancelled).
        """
        async with self._lock:
            job = self._job(job_id)
            if job.state in TERMINAL_STATES:
                raise FailedPrecondition(f"cannot cancel job {job_id!r}: it already {job.state.value}.")
            was_running = job.state is JobState.RUNNING
            if job.retry_at is None:
                self._scheduler.cancel(job_id, now=time.monotonic())
            job.retry_at = None
            self._end(job, JobState.CANCELLED, "cancelled")
            self._emit(job, EventKind.CANCELLED, "cancelled")
            if was_running:
                await self._executor.terminate(job_id, self._grace_s)
        self._wake.set()
        return job.status()

    async def preempt(self, job_id: str) -> JobStatus:
        """An administrator's preemption: stop the running job (SIGTERM, so it can checkpoint, then
        a kill after ``terminate_grace_s``) and queue it to resume; return its status, PREEMPTED.

        The scheduler preempts it as it would for a waiting job (``Scheduler.preempt``): it keeps
        its place in the queue, and the stop counts toward the scheduler's ``max_preemptions`` cap.

        Raises:
            NotFound: no job has this id.
            FailedPrecondition: the job is not running.
        """
        async with self._lock:
            job = self._job(job_id)
            if job.state is not JobState.RUNNING:
                raise FailedPrecondition(f"cannot preempt job {job_id!r}: it is {job.state.value}, not running.")
            self._scheduler.preempt(job_id, now=time.monotonic())
            self._preempted(job, "preempted by an administrator")
            await self._executor.terminate(job_id, self._grace_s)
        self._wake.set()
        return job.status()

    def get(self, job_id: str) -> JobStatus:
        """The status of a job.

        Raises:
            NotFound: no job has this id.
        """
        return self._job(job_id).status()

    def list(self) -> list[JobStatus]:
        """The status of every job submitted, in submission order."""
        return [job.status() for job in self._jobs.values()]

    # -- the loop ------------------------------------------------------------------------------

    async def _loop(self) -> None:
        poll: asyncio.Task[list[ExecutorEvent]] | None = None
        try:
            while True:
                async with self._lock:
                    await self._step()
                wait_s = self._wait_s()
                if poll is None:
                    poll = asyncio.create_task(self._executor.poll(wait_s))
                wake = asyncio.create_task(self._wake.wait())
                await asyncio.wait({poll, wake}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
                wake.cancel()
                self._wake.clear()
                if poll.done():
                    events, poll = poll.result(), None
                    async with self._lock:
                        for event in events:
                            if isinstance(event, JobEvent):
                                self._on_run_end(event)
        except Exception:
            logger.exception("the job orchestrator loop died")
            raise
        finally:
            if poll is not None:
                poll.cancel()

    async def _step(self) -> None:
        """Queue the jobs whose retry delay is over, schedule, and carry out the decisions."""
        now = time.monotonic()
        for job in self._jobs.values():
            if job.retry_at is not None and job.retry_at <= now:
                job.retry_at = None
                self._scheduler.submit(job.spec, now=now)
        for decision in self._scheduler.schedule(now=now):
            job = self._jobs[decision.job_id]
            if isinstance(decision, PreemptJob):
                self._preempted(job, f"preempted for job {decision.for_job_id!r} "
                                     f"(about {decision.lost_work_s:.1f} s of work lost)")
                await self._executor.terminate(job.spec.job_id, self._grace_s)
            else:
                await self._launch(job, decision)

    async def _launch(self, job: _Job, decision: StartJob) -> None:
        kind = EventKind.RESUMED if job.state is JobState.PREEMPTED else EventKind.STARTED
        job.attempt += 1
        try:
            await self._executor.launch(job.spec, job.program, decision.placement, attempt=job.attempt)
        except OpmlError as exc:
            self._scheduler.finish(job.spec.job_id, now=time.monotonic())
            self._end(job, JobState.FAILED, f"could not launch: {exc}")
            self._emit(job, EventKind.FAILED, job.cause or "")
            return
        job.state = JobState.RUNNING
        job.updated_at = time.time()
        if job.started_at is None:
            job.started_at = job.updated_at
        nodes = ", ".join(f"{role}: {list(nodes)}" for role, nodes in decision.placement.items())
        self._emit(job, kind, f"on {nodes}")

    def _on_run_end(self, event: JobEvent) -> None:
        """A run ended. Runs the orchestrator stopped itself (preempted, cancelled) are already
        accounted for, and older attempts' events are ignored."""
        job = self._jobs.get(event.job_id)
        if job is None or job.state is not JobState.RUNNING or event.attempt != job.attempt:
            return
        self._scheduler.finish(job.spec.job_id, now=time.monotonic())
        if event.outcome is JobOutcome.SUCCEEDED:
            self._end(job, JobState.SUCCEEDED, None)
            self._emit(job, EventKind.SUCCEEDED, event.message)
            return
        delay_s = self._retry_policy.next_delay(job.retries, retriable=event.retriable)
        if delay_s is None:
            self._end(job, JobState.FAILED, event.message)
            self._emit(job, EventKind.FAILED, event.message)
            return
        job.retries += 1
        job.state = JobState.RETRYING
        job.cause = event.message
        job.retry_at = time.monotonic() + delay_s
        job.updated_at = time.time()
        self._emit(job, EventKind.RETRYING, f"retry {job.retries} of {self._retry_policy.max_retries} "
                                            f"in {delay_s:g} s after: {event.message}")

    def _wait_s(self) -> float:
        """Seconds until the scheduler's next deadline or the next retry, at most ``max_wait_s``."""
        deadlines = [j.retry_at for j in self._jobs.values() if j.retry_at is not None]
        scheduler_deadline = self._scheduler.next_deadline()
        if scheduler_deadline is not None:
            deadlines.append(scheduler_deadline)
        if not deadlines:
            return self._max_wait_s
        return min(self._max_wait_s, max(0.0, min(deadlines) - time.monotonic()))

    # -- helpers -------------------------------------------------------------------------------

    def _job(self, job_id: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"job {job_id!r} was never submitted.")
        return job

    def _requeue(self, job: _Job, cause: str) -> None:
        """Take running ``job`` out of the scheduler's running set and queue it again to resume."""
        now = time.monotonic()
        self._scheduler.cancel(job.spec.job_id, now=now)
        self._scheduler.submit(job.spec, now=now)
        self._preempted(job, cause)

    def _preempted(self, job: _Job, cause: str) -> None:
        job.state = JobState.PREEMPTED
        job.preemptions += 1
        job.cause = cause
        job.updated_at = time.time()
        self._emit(job, EventKind.PREEMPTED, cause)

    def _end(self, job: _Job, state: JobState, cause: str | None) -> None:
        job.state = state
        job.cause = cause
        job.updated_at = job.ended_at = time.time()

    def _emit(self, job: _Job, kind: EventKind, message: str) -> None:
        event = LifecycleEvent(kind, job.spec.job_id, job.attempt, job.state, job.updated_at, message)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                logger.exception("lifecycle listener %r failed on %s", listener, event)
