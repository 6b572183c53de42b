"""Which replica schedules: the holder of the ``job-orchestrator`` lease, and what it runs while it does.

Replicas share Redis. The single-writer parts (the orchestrator: admission, placement on the
capacity model, preemption, the executor's reconcile of running jobs; the pipelines' engine, its
schedules and trigger consumers; the consumer of requests handed over by followers) make one
:class:`Tenure`, built when this replica takes the lease and stopped the moment it loses it.

Taking the lease is a restart: the tenure's orchestrator is new (an empty capacity model) and
takes its jobs back from the store through ``Orchestrator.restore``, exactly as a restarted
service does, so a run the previous leader started is re-adopted (Kubernetes pods) or counted
lost and retried (local processes), and waiting jobs keep their turn. Losing it stops the tenure at
once: nothing more is launched (the loop's ``guard`` checks the fence before each decision it
carries out), the executor stops this replica's local runs (the next leader has counted them
lost), and every state write still queued is refused by the fence, logged, not applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from opml_common.lease import LeaderLease, NotLeader
from opml_common.lifecycle import Component, cancel_and_wait
from opml_common.metrics import ServiceMetrics
from opml_job_orchestrator.orchestrator import Orchestrator
from opml_job_orchestrator.pipelines.engine import PipelineEngine

log = logging.getLogger(__name__)

LEASE = "job-orchestrator"
"""The lease whose holder schedules and runs pipelines (every replica serves the API)."""
_RETRY_S = 1.0
_FLUSH_S = 10.0


@dataclass
class Tenure:
    """What one leader runs: ``orchestrator`` and ``engine`` (already started), then ``parts``;
    ``flushed`` (the store's writes so far) is awaited last, so a clean stop's last snapshots are
    written while the lease is still held."""

    orchestrator: Orchestrator
    engine: PipelineEngine
    flushed: Callable[[], Awaitable[None]]
    parts: Sequence[Component] = field(default_factory=list)
    ended: Callable[[], None] = lambda: None
    """Called once the orchestrator stopped (the jobs' gauges forget what this replica no longer schedules)."""

    async def stop(self, *, deposed: bool = False) -> None:
        """The orchestrator first (no decision after this), then ``ended``, the parts in reverse, the
        engine, and the store's writes so far. ``deposed``: this replica lost the lease; the
        orchestrator is abandoned, not stopped (pods go on for the successor that re-adopts them;
        local runs are stopped: the successor retries them)."""
        await self._stop(self.orchestrator.abandon if deposed else self.orchestrator.stop, "the orchestrator")
        self.ended()
        for part in [*reversed(self.parts), self.engine]:
            await self._stop(part.stop, type(part).__name__)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.flushed(), _FLUSH_S)

    @staticmethod
    async def _stop(stop: Callable[[], Awaitable[None]], what: str) -> None:
        try:
            await stop()
        except NotLeader:
            pass  # its last act was refused by the fence: as it should be
        except Exception:
            log.exception("stopping %s at the end of a tenure failed", what)


class Leadership(Component):
    """Follows ``lease`` (whose ``on_change`` must call :meth:`changed`): builds a :class:`Tenure`
    with ``take_over(guard)`` when this replica takes it, stops it when it loses it.

    :attr:`tenure` is the running one, None on a follower (the API forwards then). A tenure whose
    orchestrator loop dies of a bug ends :meth:`ended` with that error (the service goes down and is
    restarted, as before replicas); one that ends on its guard's ``NotLeader`` just ends the tenure.
    """

    def __init__(self, *, lease: LeaderLease, redis: aioredis.Redis,
                 take_over: Callable[[Callable[[], Awaitable[None]]], Awaitable[Tenure]],
                 metrics: ServiceMetrics) -> None:
        super().__init__()
        self._lease, self._redis, self._take_over = lease, redis, take_over
        self._gauge = metrics.gauge("leader", "1 while this replica holds the job-orchestrator lease: it "
                                    "schedules the jobs and runs the pipelines; else 0.")
        self._gauge.set(0)
        self._transitions: asyncio.Queue[bool] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.tenure: Tenure | None = None

    def changed(self, leading: bool) -> None:
        """The lease's ``on_change`` (called in the lease's task; acted on in this one's, in order)."""
        if not leading:
            self._gauge.set(0)  # at once: the tenure's stop follows
        self._transitions.put_nowait(leading)

    async def guard(self) -> None:
        """Raises NotLeader unless this replica leads on its own clock and the fence in Redis still
        holds its tenure's token (one GET): the check before each decision the orchestrator carries out."""
        fence = self._lease.fence
        try:
            current = await self._redis.get(fence.key)
        except RedisError as exc:
            raise NotLeader(f"the {LEASE} lease's fence cannot be read ({exc}); acting on nothing") from exc
        if current is None or int(current) != fence.token:
            raise NotLeader(f"the {LEASE} lease moved on (fence {int(current or 0)}, this tenure {fence.token})")

    async def on_start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="job-orchestrator leadership")

    async def on_stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        await self._end_tenure(deposed=False)  # a clean stop: runs stopped and queued to resume, as ever

    async def ended(self) -> None:
        """Raises when a tenure's orchestrator loop died of a bug (the service runs it in the background);
        returns when this part is stopped."""
        task = self._task
        assert task is not None, "start() first"
        await asyncio.wait({task})  # not ``await task``: cancelling this wait must not cancel the task
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()

    async def _follow(self) -> None:
        leading = False
        while True:
            if leading and self.tenure is None:  # taking over failed (Redis away): try again while leading
                try:
                    leading = await asyncio.wait_for(self._transitions.get(), _RETRY_S)
                except TimeoutError:
                    await self._begin_tenure()
                    continue
            elif self.tenure is not None:
                transition = asyncio.ensure_future(self._transitions.get())
                loop_end = asyncio.ensure_future(self.tenure.orchestrator.loop_ended())
                await asyncio.wait({transition, loop_end}, return_when=asyncio.FIRST_COMPLETED)
                if loop_end.done():
                    await cancel_and_wait(transition)
                    loop_end.result()  # died of a bug: the service ends with it
                    # It ended on the guard's NotLeader: deposed before the lease's task noticed.
                    await self._end_tenure()
                    leading = self._lease.leading  # still held on its clock: take over again
                    continue
                loop_end.cancel()
                leading = transition.result()
            else:
                leading = await self._transitions.get()
            if leading and self.tenure is None:
                await self._begin_tenure()
            elif not leading:
                await self._end_tenure()

    async def _begin_tenure(self) -> None:
        log.info("job-orchestrator: this replica leads (lease %s); taking the jobs and pipelines over",
                 self._lease.holder)
        try:
            self.tenure = await self._take_over(self.guard)
        except (NotLeader, RedisError, OSError) as exc:
            log.warning("job-orchestrator: taking over failed (%s); trying again while leading", exc)
            return
        if self._lease.leading:
            self._gauge.set(1)

    async def _end_tenure(self, *, deposed: bool = True) -> None:
        tenure, self.tenure = self.tenure, None
        if tenure is None:
            return
        self._gauge.set(0)
        if deposed:
            log.warning("job-orchestrator: this replica no longer leads; it stops scheduling (pods go on for the "
                        "next leader to re-adopt; local runs are stopped: the next leader retries them)")
        await tenure.stop(deposed=deposed)
