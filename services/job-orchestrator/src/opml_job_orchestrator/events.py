"""Lifecycle events to the JOBS topic: one CloudEvent per transition, keyed by job id, through the outbox.

The orchestrator's listeners run in its loop and must not wait for the broker, yet an event must
not live only in memory: :meth:`LifecyclePublisher.publish` builds the event (its id and time are
the transition's) and records it with :meth:`~opml_common.outbox.Outbox.record`, a synchronous,
fsync'd write, so it is on disk before the state change returns, and a crash right after loses
nothing. The outbox's own task publishes it (and retries while the broker is away, after a
restart too). ce_subject, and so the Kafka key, is the job id: one job's events stay in one
partition, in order.
"""

from __future__ import annotations

import logging

from google.protobuf.message import Message

from opml_common.bus import CloudEvent
from opml_common.outbox import Outbox
from opml_common.topics import JOBS

logger = logging.getLogger(__name__)

EVENT_SOURCE = "opml/job-orchestrator"


class LifecyclePublisher:
    """Records lifecycle events in ``outbox`` (started by its owner), in the order they happen."""

    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox

    def publish(self, job_id: str, data: Message) -> None:
        """Record a CloudEvent carrying ``data`` about ``job_id`` on disk; never waits for the broker."""
        event = CloudEvent.from_proto(data, source=EVENT_SOURCE, subject=job_id)
        try:
            self._outbox.record(JOBS, event)
        except OSError:  # the disk is full or gone: say so loudly, keep the orchestrator going
            logger.exception("could not record event %s (%s of job %s) in the outbox", event.id, event.type, job_id)
