"""Fan-out of job changes to watch streams, without letting a slow watcher slow the orchestrator.

:meth:`WatchHub.notify` runs in the orchestrator's loop (a lifecycle listener) and never waits:
each watcher has a bounded backlog, and a watcher that falls ``limit`` changes behind is dropped;
its stream then ends with RESOURCE_EXHAUSTED and says why, and the client may watch again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from opml.jobs.v1 import jobs_pb2 as pb

from opml_common.errors import InvalidArgument, ResourceExhausted

_OVERFLOW = None


class Watcher:
    """One watch stream's backlog of changes (of one job, or of all when ``job_id`` is None)."""

    def __init__(self, job_id: str | None, limit: int) -> None:
        self.job_id = job_id
        self._limit = limit
        self._queue: asyncio.Queue[pb.JobChange | None] = asyncio.Queue()
        self.dropped = False

    def offer(self, change: pb.JobChange) -> bool:
        """Queue ``change``; False (and the watcher is dropped) when its backlog is full."""
        if self._queue.qsize() >= self._limit:
            self.dropped = True
            self._queue.put_nowait(_OVERFLOW)
            return False
        self._queue.put_nowait(change)
        return True

    async def next(self) -> pb.JobChange:
        """The next change, oldest first.

        Raises:
            ResourceExhausted: the watcher fell too far behind and was dropped.
        """
        change = await self._queue.get()
        if change is _OVERFLOW:
            raise ResourceExhausted(f"the watcher fell {self._limit} changes behind and was dropped so as not to "
                                    "slow the orchestrator; read faster or watch one job, then watch again")
        return change


class WatchHub:
    """The watchers of the service; ``limit`` is each one's backlog bound."""

    def __init__(self, *, limit: int = 1000) -> None:
        if not isinstance(limit, int) or limit < 1:
            raise InvalidArgument("limit", f"`limit` must be an integer >= 1, but got {limit!r}.")
        self._limit = limit
        self._watchers: set[Watcher] = set()

    def notify(self, change: pb.JobChange) -> None:
        """Offer ``change`` to every watcher of its job or of all jobs; never blocks."""
        for watcher in list(self._watchers):
            if watcher.job_id in (None, change.status.job_id) and not watcher.offer(change):
                self._watchers.discard(watcher)

    @contextmanager
    def subscribe(self, job_id: str | None) -> Iterator[Watcher]:
        """A watcher that sees every change from now on until the ``with`` block ends."""
        watcher = Watcher(job_id, self._limit)
        self._watchers.add(watcher)
        try:
            yield watcher
        finally:
            self._watchers.discard(watcher)
