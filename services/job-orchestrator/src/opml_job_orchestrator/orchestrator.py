"""The orchestrator loop: it joins the scheduler, which decides, and an executor, which runs jobs.

:class:`Orchestrator` imports no transport. The gRPC servicer calls :meth:`Orchestrator.submit`,
:meth:`~Orchestrator.cancel`, :meth:`~Orchestrator.preempt`, :meth:`~Orchestrator.get` and
:meth:`~Orchestrator.list`; :data:`LifecycleListener` s receive every :class:`LifecycleEvent`
(in the service, one :class:`~opml_job_orchestrator.recorder.JobRecorder` saves the job to Redis,
emits its domain event, shows it to watch streams and counts it). After a restart,
:meth:`~Orchestrator.restore` takes back the jobs the store kept.

One loop task, in steps: resubmit the jobs whose retry delay is over, call ``Scheduler.schedule``
and carry out its decisions in order (``Executor.terminate`` for a ``PreemptJob``, then
``Executor.launch`` for a ``StartJob``), then wait for ``Executor.poll`` until the scheduler's
``next_deadline()`` or the next retry, or until a submit or cancel wakes it. A ``CheckpointEvent``
goes to ``Scheduler.record_checkpoint`` (so a preemption knows how little it loses). A ``JobEvent`` ends a
run: success finishes the job in the scheduler; a failure frees its room and, if the
:class:`~opml_job_orchestrator.executor.retry.RetryPolicy` gives a delay (it tests the event's
``retriable``), queues it again after that delay, else fails it with the event's message as cause.

With replicas, only the one holding the ``job-orchestrator`` lease runs an orchestrator; its
``guard`` (the lease's fence, read from Redis) is awaited before each decision is carried out
(a launch, a preemption's stop), so a deposed leader that wakes from a stall launches nothing:
its loop ends (``loop_ended`` returns).

Each run has its own ``attempt`` (``OPML_JOB_ATTEMPT``): 0 first, then one more for every retry and
every resume after a preemption, so a resumed run knows to load its checkpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, fields

from opml_common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, OpmlError
from opml_common.lease import NotLeader
from opml_common.lifecycle import Component, cancel_and_wait
from opml_job_orchestrator.executor.base import (
    CheckpointEvent,
    Executor,
    ExecutorEvent,
    JobEvent,
    JobOutcome,
    JobProgram,
    check_seconds,
)
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
    SCHEDULED = "scheduled"
    """The scheduler placed the job; its run is being launched (the message names the nodes)."""
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
    a preemption, a cancel), None while nothing stopped it. ``checkpoint_step`` is the step of the
    last checkpoint a run reported (a ``CheckpointEvent``), None until one did.
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
    checkpoint_step: int | None = None


@dataclass(frozen=True, slots=True)
class JobDefinition:
    """What was submitted: the scheduler's spec, the program each role runs, the job's own
    retry budget (None: the orchestrator's ``retry_policy.max_retries``), and the name of the
    principal who submitted it (set by the service from the authenticated caller, never from the
    request; None: unknown, for a job saved before submitters were kept: only admins may act on it)."""

    spec: JobSpec
    program: JobProgram
    max_retries: int | None = None
    submitter: str | None = None
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """What the submitter says the job belongs to (an experiment's trial); kept and listed, nothing more."""


@dataclass(frozen=True, slots=True)
class SavedJob:
    """A job's definition and status at one moment: what each :class:`LifecycleEvent` carries, what a
    durable store keeps, and what :meth:`Orchestrator.restore` takes back after a restart."""

    definition: JobDefinition
    status: JobStatus


@dataclass(frozen=True, slots=True)
class LifecycleEvent:
    """``job_id`` went through ``kind`` at ``at`` (Unix seconds), in run ``attempt``, now in ``state``;
    ``job`` is the whole job just after the change (its definition and status)."""

    kind: EventKind
    job_id: str
    attempt: int
    state: JobState
    at: float
    job: SavedJob
    message: str = ""


LifecycleListener = Callable[[LifecycleEvent], None]
"""Called in the loop, in order, for every :class:`LifecycleEvent`, before the transition returns
(the service's is a :class:`~opml_job_orchestrator.recorder.JobRecorder`). It must not block: a
store queues the snapshot and writes it from its own task. What it raises is logged and dropped."""


class _Job:
    __slots__ = ("definition", "retry_policy", "state", "attempt", "retries", "preemptions",
                 "cause", "submitted_at", "started_at", "updated_at", "ended_at", "checkpoint_step")

    def __init__(self, definition: JobDefinition, retry_policy: RetryPolicy, now: float) -> None:
        self.definition = definition
        self.retry_policy = retry_policy
        self.state = JobState.PENDING
        self.attempt = -1
        self.retries = 0
        self.preemptions = 0
        self.cause: str | None = None
        self.submitted_at = now
        self.started_at: float | None = None
        self.updated_at = now
        self.ended_at: float | None = None
        self.checkpoint_step: int | None = None

    @property
    def spec(self) -> JobSpec:
        return self.definition.spec

    @property
    def program(self) -> JobProgram:
        return self.definition.program

    def status(self) -> JobStatus:
        return JobStatus(self.spec.job_id, self.state, self.attempt, self.retries, self.preemptions, self.cause,
                         self.submitted_at, self.started_at, self.updated_at, self.ended_at, self.checkpoint_step)

    def restore(self, status: JobStatus) -> None:
        for field in fields(status):
            if field.name != "job_id":  # the spec's
                setattr(self, field.name, getattr(status, field.name))


class Orchestrator(Component):
    """Runs submitted jobs on ``executor`` in the order and places ``scheduler`` decides.

    Keyword-only settings, checked here: ``scheduler`` (the orchestrator is its only caller from
    now on), ``executor`` (the orchestrator starts and stops it), ``retry_policy`` for failed runs,
    ``listeners`` for lifecycle events, ``terminate_grace_s`` between SIGTERM and the kill when a
    run is preempted or cancelled (time for a BE job to write its checkpoint), and ``max_wait_s``,
    the longest the loop waits for executor events before it schedules again, and ``guard``, awaited
    before each decision is carried out (raises ``NotLeader`` once this replica no longer leads: the
    loop ends there, having done nothing more, and ``loop_ended`` returns).

    Every method is called from the event loop the orchestrator was started in. State lives in
    memory; a listener may keep it durably and hand it back to :meth:`restore` after a restart.
    """

    def __init__(self, *, scheduler: Scheduler, executor: Executor, retry_policy: RetryPolicy,
                 listeners: Sequence[LifecycleListener] = (), terminate_grace_s: float = 30.0,
                 max_wait_s: float = 1.0, guard: Callable[[], Awaitable[None]] | None = None) -> None:
        if not isinstance(scheduler, Scheduler):
            raise InvalidArgument("scheduler", f"`scheduler` must be a Scheduler, but got {scheduler!r}.")
        if not isinstance(executor, Executor):
            raise InvalidArgument("executor", f"`executor` must be an Executor, but got {executor!r}.")
        if not isinstance(retry_policy, RetryPolicy):
            raise InvalidArgument("retry_policy", f"`retry_policy` must be a RetryPolicy, but got {retry_policy!r}.")
        if isinstance(listeners, str) or not isinstance(listeners, Sequence) or not all(map(callable, listeners)):
            raise InvalidArgument("listeners", f"`listeners` must be a list of callables, but got {listeners!r}.")
        super().__init__()
        self._scheduler = scheduler
        self._executor = executor
        self._retry_policy = retry_policy
        self._listeners = tuple(listeners)
        self._grace_s = check_seconds(terminate_grace_s, "terminate_grace_s", positive=False)
        self._max_wait_s = check_seconds(max_wait_s, "max_wait_s", positive=True)
        self._guard = guard
        self._jobs: dict[str, _Job] = {}
        self._retry_at: dict[str, float] = {}
        """Monotonic time to queue each RETRYING job again, until it is queued (due ones go in the
        order their runs failed): the loop looks only at these, not at every job ever submitted."""
        self._lock = asyncio.Lock()
        """Held while the loop acts on the scheduler and executor, and by cancel and preempt."""
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._abandoning = False

    # -- lifecycle -----------------------------------------------------------------------------

    async def on_start(self) -> None:
        """Start the executor, then the loop task.

        Jobs submitted before, or preempted by a previous :meth:`stop`, start from the first step.
        """
        await self._executor.start()
        self._loop_task = asyncio.create_task(self._loop(), name="job-orchestrator-loop")

    async def on_stop(self) -> None:
        """Stop the loop task, then the executor: every run still going gets SIGTERM, then a kill
        after the executor's grace. Those jobs go back to the queue as PREEMPTED (a later
        :meth:`start` resumes them); jobs waiting stay queued.

        Raises:
            Whatever ended the loop task, if it died of an error (a bug): it is logged as well.
        """
        task, self._loop_task = self._loop_task, None
        try:
            async with self._lock:  # never cancel the loop halfway through a terminate or a launch
                await cancel_and_wait(task)
        finally:
            if self._abandoning:
                await self._executor.release()
            else:
                await self._executor.stop()
                for job in [j for j in self._jobs.values() if j.state is JobState.RUNNING]:
                    self._requeue(job, "the orchestrator stopped")

    async def abandon(self) -> None:
        """Stop at once, leaving the runs going to another orchestrator: the loop ends, and an
        ``adoptable`` executor is released (its runs are neither stopped nor requeued: the next
        leader re-adopts them); any other executor is stopped as :meth:`stop` does, its runs'
        requeue being the next leader's to record (this one's writes are refused by then)."""
        self._abandoning = self._executor.adoptable
        await self.stop()

    def loop_ended(self) -> Awaitable[None]:
        """What returns once the loop task running now ends (:meth:`stop` ended it), or raises what
        ended it if it died.

        The service runs this in the background, so a loop dead of a bug takes the service down (and
        a supervisor restarts it) instead of leaving a server that takes jobs and runs none.

        Raises:
            FailedPrecondition: the orchestrator is not started (raised at once).
            Whatever ended the loop task, if it died of an error (raised by the awaitable).
        """
        task = self._loop_task
        if task is None:
            raise FailedPrecondition("the orchestrator is not started; call start() first.")
        return _ended(task)

    # -- requests ------------------------------------------------------------------------------

    def submit(self, spec: JobSpec, program: JobProgram, *, max_retries: int | None = None,
               submitter: str | None = None, labels: Mapping[str, str] | None = None) -> str:
        """Queue ``spec`` to run ``program``; return its job id. It starts at the loop's next step.

        ``max_retries`` is the job's own retry budget (None: ``retry_policy.max_retries``); the
        delays are the orchestrator's ``retry_policy``'s. ``submitter`` names the principal who
        submitted it (the service passes the authenticated caller's), kept in its definition, as are
        its ``labels``.

        Raises:
            InvalidArgument: ``spec`` or ``program`` is of the wrong type, ``program`` has no command
                for a role of ``spec``, ``max_retries`` is not an integer >= 0, or the scheduler
                rejects the spec (bigger than the cluster: the field path names what).
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
        retry_policy = self._job_retry_policy(max_retries)
        self._scheduler.submit(spec, now=time.monotonic())
        definition = JobDefinition(spec, program, max_retries, submitter, dict(labels or {}))
        job = self._jobs[spec.job_id] = _Job(definition, retry_policy, time.time())
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
            if self._retry_at.pop(job_id, None) is None:
                self._scheduler.cancel(job_id, now=time.monotonic())
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

    def definition(self, job_id: str) -> JobDefinition:
        """What was submitted as ``job_id``.

        Raises:
            NotFound: no job has this id.
        """
        return self._job(job_id).definition

    async def restore(self, saved: Sequence[SavedJob]) -> None:
        """Take back the jobs a durable store kept, in their submission order, before :meth:`start`.

        Starts the executor. Ended jobs are kept for :meth:`get` and :meth:`list`; waiting jobs
        (pending, preempted, retrying) are queued again in their original order. A job is never
        run twice at once: for each job that was running, ``Executor.recover`` takes over its run.
        An executor that stops the run (local processes) returns None: the run counts as lost, a
        retriable failure, and the job is retried from its checkpoint within its retry budget, or
        fails with that cause. One that re-adopts it (Kubernetes pods) returns where its tasks
        run, and ``Scheduler.adopt`` counts the job there, RUNNING, before any waiting job is
        queued; a re-adopted run that no longer fits there (the cluster was reconfigured) is
        stopped and queued (PREEMPTED). For each waiting job, ``recover`` also takes over its
        saved attempt and the next one, in case either was launched after the store's last record
        (the SCHEDULED record counts the attempt before its launch); such a run is stopped, and its
        number is not used again. A waiting job, or one whose run was lost, that
        the cluster can no longer hold at all (too big, or its replicas no longer pack) fails with
        that cause. Transitions go to the listeners like any other.

        Raises:
            FailedPrecondition: the orchestrator is started, or already knows one of the jobs.
            InvalidArgument: a saved definition is invalid (nothing is restored then).
        """
        if self._loop_task is not None:
            raise FailedPrecondition("restore() must be called before start().")
        jobs: list[_Job] = []
        for item in saved:
            definition = item.definition
            if definition.spec.job_id in self._jobs or any(j.spec.job_id == definition.spec.job_id for j in jobs):
                raise FailedPrecondition(f"job {definition.spec.job_id!r} is already known; restore() once, first.")
            definition.program.check_covers(definition.spec)
            job = _Job(definition, self._job_retry_policy(definition.max_retries), item.status.submitted_at)
            job.restore(item.status)
            jobs.append(job)
        await self._executor.start()
        async with self._lock:
            adopted: list[tuple[_Job, Mapping[str, tuple[str, ...]]]] = []
            lost: list[_Job] = []
            for job in jobs:
                self._jobs[job.spec.job_id] = job
                if job.state is JobState.RUNNING:
                    placement = await self._executor.recover(job.spec.job_id, job.attempt)
                    if placement is None:
                        lost.append(job)
                    else:
                        adopted.append((job, placement))
                elif job.state not in TERMINAL_STATES:
                    # Its saved attempt may have been launched after its last record (the SCHEDULED
                    # one, attempt already counted, was the last written): stop that run too; the
                    # next launch is one more anyway.
                    if job.attempt >= 0 and await self._executor.recover(job.spec.job_id, job.attempt) is not None:
                        await self._executor.terminate(job.spec.job_id, self._grace_s)
                    if await self._executor.recover(job.spec.job_id, job.attempt + 1) is not None:
                        await self._executor.terminate(job.spec.job_id, self._grace_s)
                        job.attempt += 1  # that run's number is taken: the next one is one more
            # What the runs recover stopped reported is accounted for below; what a re-adopted run reported is kept.
            reported = await self._executor.poll(0)
            now = time.monotonic()
            for job, placement in adopted:
                await self._adopt(job, placement, now)
            for job in lost:
                self._retry_or_fail(job, f"run {job.attempt} was lost: the orchestrator restarted while it ran",
                                    retriable=True)
            for event in reported:
                if isinstance(event, JobEvent):
                    self._on_run_end(event)
                elif isinstance(event, CheckpointEvent):
                    self._on_checkpoint(event)
            for job in jobs:
                if job.state in (JobState.PENDING, JobState.PREEMPTED):
                    self._admit_restored(job, lambda spec: self._scheduler.submit(spec, now=now))
                elif job.state is JobState.RETRYING:  # saved so, or its run was lost above
                    if self._admit_restored(job, self._scheduler.check_admissible):
                        self._retry_at.setdefault(job.spec.job_id, now)
        self._wake.set()

    async def _adopt(self, job: _Job, placement: Mapping[str, tuple[str, ...]], now: float) -> None:
        """Count a re-adopted run where it runs; if it no longer fits there, stop it and let it wait its turn."""
        try:
            self._scheduler.adopt(job.spec, placement, now=now)
            return
        except (InvalidArgument, FailedPrecondition) as exc:
            cause = f"its run no longer fits where it runs after a restart: {exc.message}"
        await self._executor.terminate(job.spec.job_id, self._grace_s)
        self._preempted(job, cause)  # queued with the waiting jobs, in its submission order

    def _admit_restored(self, job: _Job, admit: Callable[[JobSpec], object]) -> bool:
        """``admit(spec)`` a restored job; one the cluster can no longer hold (it was reconfigured) fails."""
        try:
            admit(job.spec)
        except InvalidArgument as exc:
            cause = f"the cluster can no longer hold it after a restart: {exc.message}"
            self._retry_at.pop(job.spec.job_id, None)  # a lost run's retry is due already
            self._fail(job, cause)
            return False
        return True

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
                            elif isinstance(event, CheckpointEvent):
                                self._on_checkpoint(event)
        except NotLeader as exc:  # the loop ends, having done nothing more: not an error
            logger.warning("the job orchestrator loop stopped: this replica no longer leads (%s)", exc)
        except Exception:
            logger.exception("the job orchestrator loop died")
            raise
        finally:
            if poll is not None:
                poll.cancel()

    async def _step(self) -> None:
        """Queue the jobs whose retry delay is over, schedule, and carry out the decisions."""
        now = time.monotonic()
        for job_id in [job_id for job_id, at in self._retry_at.items() if at <= now]:
            del self._retry_at[job_id]
            try:
                self._scheduler.submit(self._jobs[job_id].spec, now=now)
            except InvalidArgument as exc:  # the cluster can no longer hold it: this job fails, not the loop
                self._fail(self._jobs[job_id], f"its retry cannot be scheduled: {exc.message}")
        for decision in self._scheduler.schedule(now=now):
            job = self._jobs[decision.job_id]
            if self._guard is not None:
                await self._guard()
            if isinstance(decision, PreemptJob):
                self._preempted(job, f"preempted for job {decision.for_job_id!r} "
                                     f"(about {decision.lost_work_s:.1f} s of work lost)")
                await self._executor.terminate(job.spec.job_id, self._grace_s)
            else:
                await self._launch(job, decision)

    async def _launch(self, job: _Job, decision: StartJob) -> None:
        kind = EventKind.RESUMED if job.state is JobState.PREEMPTED else EventKind.STARTED
        nodes = ", ".join(f"{role}: {list(nodes)}" for role, nodes in decision.placement.items())
        job.attempt += 1
        job.updated_at = time.time()
        self._emit(job, EventKind.SCHEDULED, f"placed on {nodes}")
        try:
            await self._executor.launch(job.spec, job.program, decision.placement, attempt=job.attempt)
        except OpmlError as exc:
            self._scheduler.finish(job.spec.job_id, now=time.monotonic())
            self._fail(job, f"could not launch: {exc}")
            return
        except Exception as exc:  # a bug, or the host failing (a full disk): this job fails, the loop runs on
            logger.exception("launching job %r (attempt %d) failed unexpectedly", job.spec.job_id, job.attempt)
            await self._stop_half_launched(job)
            self._scheduler.finish(job.spec.job_id, now=time.monotonic())
            self._fail(job, f"could not launch: the executor failed unexpectedly ({type(exc).__name__}; "
                            "the orchestrator's log has the details)")
            return
        job.state = JobState.RUNNING
        job.updated_at = time.time()
        if job.started_at is None:
            job.started_at = job.updated_at
        self._emit(job, kind, f"on {nodes}")

    async def _stop_half_launched(self, job: _Job) -> None:
        """Stop what a launch that raised may have started of ``job``'s run (nothing, if it tracked none)."""
        try:
            await self._executor.terminate(job.spec.job_id, self._grace_s)
        except NotFound:
            pass
        except Exception:
            logger.exception("stopping what the failed launch of job %r started failed", job.spec.job_id)

    def _on_checkpoint(self, event: CheckpointEvent) -> None:
        """A run saved a checkpoint: stopping it now loses little. Older attempts' reports are ignored."""
        job = self._jobs.get(event.job_id)
        if job is None or job.state is not JobState.RUNNING or event.attempt != job.attempt:
            return
        self._scheduler.record_checkpoint(job.spec.job_id, now=time.monotonic())
        job.checkpoint_step = event.step

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
        self._retry_or_fail(job, event.message, retriable=event.retriable)

    def _retry_or_fail(self, job: _Job, cause: str, *, retriable: bool) -> None:
        """A run of ``job`` (no longer in the scheduler) failed: retry it after the policy's delay, or fail it."""
        delay_s = job.retry_policy.next_delay(job.retries, retriable=retriable)
        if delay_s is None:
            self._fail(job, cause)
            return
        job.retries += 1
        job.state = JobState.RETRYING
        job.cause = cause
        self._retry_at[job.spec.job_id] = time.monotonic() + delay_s
        job.updated_at = time.time()
        self._emit(job, EventKind.RETRYING, f"retry {job.retries} of {job.retry_policy.max_retries} "
                                            f"in {delay_s:g} s after: {cause}")

    def _job_retry_policy(self, max_retries: int | None) -> RetryPolicy:
        """The orchestrator's retry policy with ``max_retries`` as the budget (None: its own)."""
        if max_retries is None:
            return self._retry_policy
        backoff = self._retry_policy.backoff
        return RetryPolicy(max_retries=max_retries, base_delay_s=backoff.base_s, max_delay_s=backoff.max_s,
                           multiplier=backoff.multiplier)

    def _wait_s(self) -> float:
        """Seconds until the scheduler's next deadline or the next retry, at most ``max_wait_s``."""
        deadlines = list(self._retry_at.values())
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

    def _fail(self, job: _Job, cause: str) -> None:
        self._end(job, JobState.FAILED, cause)
        self._emit(job, EventKind.FAILED, cause)

    def _emit(self, job: _Job, kind: EventKind, message: str) -> None:
        event = LifecycleEvent(kind, job.spec.job_id, job.attempt, job.state, job.updated_at,
                               SavedJob(job.definition, job.status()), message)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                logger.exception("lifecycle listener %r failed on %s", listener, event)


async def _ended(task: asyncio.Task[None]) -> None:
    """Wait for ``task``; raise what it died of, if anything (its cancellation is a normal end)."""
    await asyncio.wait({task})
    if not task.cancelled() and task.exception() is not None:
        raise task.exception()
