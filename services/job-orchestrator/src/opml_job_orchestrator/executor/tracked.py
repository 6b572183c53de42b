"""What every executor does the same way around its backend: it keeps one tracked run per job.

:class:`TrackedRunExecutor` owns the bookkeeping both backends need whatever a task is (a
process, a pod): the runs by job, the event queue, the background tasks, the argument and state
checks of :meth:`~Executor.launch` and :meth:`~Executor.recover`, :meth:`~Executor.terminate`,
the :meth:`~Executor.on_stop` skeleton, and ending a run exactly once (decide, stop what still runs,
then report the ``JobEvent``). A backend says only how it starts and stops, launches, polls,
stops tasks, reads logs and recovers.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from opml_common.errors import FailedPrecondition, NotFound
from opml_job_orchestrator.executor.base import (
    Executor,
    ExecutorEvent,
    JobEvent,
    JobOutcome,
    JobProgram,
    check_attempt,
    check_placement,
    check_seconds,
)
from opml_job_orchestrator.executor.tony import RunTracker, Verdict
from opml_job_orchestrator.scheduler.model import JobSpec


@dataclass(eq=False)
class TrackedRun:
    """One run an executor tracks: TonY's rules for it, where its tasks are, and when it ended.

    A backend subclasses it with what it needs to reach the run's tasks (processes, pod names).
    """

    tracker: RunTracker
    placement: dict[str, tuple[str, ...]]
    """Role -> node of each replica, as ``StartJob.placement``: what :meth:`Executor.recover` returns."""
    done: asyncio.Event = field(default_factory=asyncio.Event, kw_only=True)
    """Set once the run's ``JobEvent`` is queued: every task of it has stopped."""

    @property
    def job_id(self) -> str:
        return self.tracker.job_id

    @property
    def attempt(self) -> int:
        return self.tracker.attempt


RunT = TypeVar("RunT", bound=TrackedRun)


class TrackedRunExecutor(Executor, Generic[RunT]):
    """An :class:`Executor` that tracks the latest run of each job as a ``RunT``.

    ``cleanup_grace_s`` is the grace given to the tasks still running when a run ends on its own
    (parameter servers, for one); ``shutdown_grace_s`` the one :meth:`stop` gives. Subclasses
    implement :meth:`_open`, :meth:`_launch`, :meth:`_recover` and :meth:`_stop_tasks`, plus
    :meth:`poll` and :meth:`logs`; they queue their events on ``self._events``.
    """

    def __init__(self, *, cleanup_grace_s: float, shutdown_grace_s: float) -> None:
        self._cleanup_grace_s = check_seconds(cleanup_grace_s, "cleanup_grace_s", positive=False)
        self._shutdown_grace_s = check_seconds(shutdown_grace_s, "shutdown_grace_s", positive=False)
        self._runs: dict[str, RunT] = {}
        self._events: asyncio.Queue[ExecutorEvent] = asyncio.Queue()
        self._background: set[asyncio.Task[None]] = set()
        super().__init__()

    async def release(self) -> None:
        """Stop, leaving every run going, untracked (see :meth:`Executor.release`): their tasks are
        neither stopped nor reported; another orchestrator's :meth:`recover` takes them over."""
        if not self.adoptable:
            await super().release()
        self._runs.clear()
        await self.stop()

    async def on_start(self) -> None:
        """Get the backend ready (:meth:`_open`)."""
        await self._open()

    async def on_stop(self) -> None:
        """End every run still going (grace ``shutdown_grace_s``), then release the backend (:meth:`_close`).

        Unread events stay readable with :meth:`poll`; :meth:`launch` is refused from the moment it begins.
        """
        await asyncio.gather(*(self._end(run, Verdict(JobOutcome.STOPPED, "the executor stopped", False),
                                         grace_s=self._shutdown_grace_s) for run in list(self._runs.values())))
        await self._close()
        await asyncio.gather(*self._background)

    async def launch(self, spec: JobSpec, program: JobProgram, placement: Mapping[str, Sequence[str]], *,
                     attempt: int) -> None:
        check_attempt(attempt)
        program.check_covers(spec)
        check_placement(spec, placement)
        self._check_free(spec.job_id, attempt)
        await self._launch(spec, program, {role: tuple(nodes) for role, nodes in placement.items()}, attempt=attempt)

    async def recover(self, job_id: str, attempt: int) -> Mapping[str, tuple[str, ...]] | None:
        check_attempt(attempt)
        current = self._runs.get(job_id)
        if current is not None and current.attempt == attempt:
            return current.placement if current.tracker.outcome is None else None
        self._check_free(job_id, attempt)
        return await self._recover(job_id, attempt)

    async def terminate(self, job_id: str, grace_s: float) -> None:
        grace_s = check_seconds(grace_s, "grace_s", positive=False)
        run = self._runs.get(job_id)
        if run is None:
            raise NotFound(f"job {job_id!r} was never launched on this executor.")
        await self._end(run, Verdict(JobOutcome.STOPPED, f"terminated with a grace period of {grace_s:g} s", False),
                        grace_s=grace_s)

    # -- what a backend implements -------------------------------------------------------------

    @abc.abstractmethod
    async def _open(self) -> None:
        """Get ready to launch (create folders, connect): called by the first :meth:`start`."""

    async def _close(self) -> None:
        """Release what :meth:`_open` took: called by :meth:`stop` once every run ended. Nothing by default."""

    @abc.abstractmethod
    async def _launch(self, spec: JobSpec, program: JobProgram, placement: dict[str, tuple[str, ...]], *,
                      attempt: int) -> None:
        """Track run ``attempt`` in ``self._runs`` and start its tasks, as :meth:`Executor.launch` says:
        called once the arguments were checked and no run of the job goes.

        A task that cannot start fails the run: queue its event, then :meth:`_end_soon`.
        """

    @abc.abstractmethod
    async def _recover(self, job_id: str, attempt: int) -> Mapping[str, tuple[str, ...]] | None:
        """Take over run ``attempt`` of ``job_id``, as :meth:`Executor.recover` says: called once the
        arguments were checked, when this executor does not track that run and no run of the job goes."""

    @abc.abstractmethod
    async def _stop_tasks(self, run: RunT, grace_s: float) -> None:
        """Stop what still runs of ``run`` (SIGTERM, or its equivalent, then a kill after ``grace_s``)
        and queue the task events of how they ended: called once per run, just after it was decided,
        before its ``JobEvent`` is queued. Returns once no task of it runs."""

    # -- shared by the backends ----------------------------------------------------------------

    def _check_free(self, job_id: str, attempt: int) -> None:
        """Raise FailedPrecondition unless the executor is started and no run of ``job_id`` goes."""
        if not self.running:
            raise FailedPrecondition("the executor is not started; call start() or use `async with` first.")
        previous = self._runs.get(job_id)
        if previous is not None and previous.tracker.outcome is None:
            raise FailedPrecondition(f"job {job_id!r} still runs attempt {previous.attempt}; terminate it "
                                     f"before running attempt {attempt}.")

    async def _end(self, run: RunT, verdict: Verdict, *, grace_s: float) -> None:
        """End the run once: stop what still runs (:meth:`_stop_tasks`), then report the JobEvent.

        A later call (a terminate while the run ends on its own) waits until the first one is done.
        """
        if not run.tracker.decide(verdict):
            await run.done.wait()
            return
        await self._stop_tasks(run, grace_s)
        self._report_end(run, verdict)

    def _end_soon(self, run: RunT, verdict: Verdict) -> None:
        """The run ended on its own (a task failed, the awaited ones succeeded): :meth:`_end` it with
        ``cleanup_grace_s`` in the background, so the caller (a launch, a poll) does not wait."""
        self._in_background(self._end(run, verdict, grace_s=self._cleanup_grace_s))

    def _report_end(self, run: RunT, verdict: Verdict) -> None:
        """Queue the run's ``JobEvent`` and mark it done: no task of it may run any more."""
        self._events.put_nowait(JobEvent(run.job_id, run.attempt, verdict.outcome, verdict.message,
                                         verdict.retriable))
        run.done.set()

    def _in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task that :meth:`stop` waits for."""
        job = asyncio.create_task(coro)
        self._background.add(job)
        job.add_done_callback(self._background.discard)
