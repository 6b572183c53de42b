"""Lifecycle events to the JOBS topic: one CloudEvent per transition, keyed by job id, through the outbox.

The orchestrator's listeners must not block its loop, and a slow or absent broker must neither
lose an event nor stall the loop: :meth:`LifecyclePublisher.publish` builds the event at once
(its id and time are the transition's) and queues it; one task hands events, in order, to the
durable :class:`~opml_common.outbox.Outbox`, which keeps whatever the broker does not
acknowledge and retries it (after a restart too). ce_subject, and so the Kafka key, is the job
id: one job's events stay in one partition, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from google.protobuf.message import Message

from opml_common.bus import CloudEvent
from opml_common.outbox import Outbox
from opml_common.topics import JOBS

logger = logging.getLogger(__name__)

EVENT_SOURCE = "opml/job-orchestrator"


class LifecyclePublisher:
    """Queues lifecycle events and records them in ``outbox`` in order.

    ``start()`` begins the task; ``stop()`` records what is queued, then ends it (the outbox,
    stopped after it, flushes or keeps them). Both idempotent.
    """

    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox
        self._queue: asyncio.Queue[CloudEvent] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    def publish(self, job_id: str, data: Message) -> None:
        """Queue a CloudEvent carrying ``data`` about ``job_id``; never blocks."""
        self._queue.put_nowait(CloudEvent.from_proto(data, source=EVENT_SOURCE, subject=job_id))

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="job-events")

    async def stop(self) -> None:
        if self._task is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._queue.join(), timeout=10)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None

    async def _run(self) -> None:
        while True:
            event = await self._queue.get()
            try:
                await self._outbox.publish(JOBS, event)  # False: kept on disk, the outbox retries
            except Exception:  # noqa: BLE001 - the disk is full or gone: say so, keep the loop going
                logger.exception("could not record event %s in the outbox", event.id)
            finally:
                self._queue.task_done()
