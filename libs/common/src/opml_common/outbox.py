"""A durable outbox: events are written to disk before they are published, deleted after the ack.

A service whose state change is already durable (a committed bundle) must not lose the event
that announces it when the broker is down. It records the event here first; ``flush()``
publishes what is pending, oldest first, and a background task keeps retrying. After a crash,
the next start publishes what was left, so delivery is at least once; consumers deduplicate by
event id, which stays the same across retries. An event the broker refuses for good (larger than
it takes), or a file that holds no event, is moved to ``<directory>.failed``, logged and counted,
so it never holds back the events after it.

``publish`` records and flushes at once (an RPC that answers after the broker's ack, when it can).
``record`` only records, synchronously, and wakes the background task: for callers that must
not wait for the broker, or cannot await at all (a state machine's listener), yet must have the
event on disk before they go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from opml_common.bus.cloudevents import CloudEvent
from opml_common.lifecycle import Component, cancel_and_wait
from opml_common.topics import Topic

if TYPE_CHECKING:
    from opml_common.bus.producer import EventPublisher
    from opml_common.metrics import ServiceMetrics

log = logging.getLogger(__name__)


class Outbox(Component):
    """Events waiting for the broker's ack, one file each under ``directory``.

    ``start()`` begins a background flush loop; ``stop()`` ends it after one last flush attempt.
    What cannot be published is moved to ``<directory>.failed``: beside the folder, not in it, so a
    spool's run folder is still removed once empty (and its dotted name is no run folder).
    ``metrics`` None: no ``outbox_pending_events`` gauge, ``outbox_failed_events_total`` or
    ``outbox_flush_errors_total`` counter (a process nobody scrapes).
    """

    def __init__(self, directory: Path, publisher: EventPublisher, metrics: ServiceMetrics | None,
                 *, retry_interval_s: float = 2.0) -> None:
        super().__init__()
        self._dir = directory
        self._dir.mkdir(parents=True, exist_ok=True)
        self._failed_dir = directory.with_name(f"{directory.name}.failed")
        self._publisher = publisher
        self._retry_interval_s = retry_interval_s
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._pending = self._failed = self._loop_errors = None
        if metrics is not None:
            self._pending = metrics.gauge("outbox_pending_events", "Events recorded but not yet acked by the broker.")
            self._pending.set(len(self._files()))  # then counted by _write and flush, never listed again
            self._failed = metrics.counter(
                "outbox_failed_events", "Files moved to the outbox's failed folder, by reason: the broker refused "
                "the event for good (refused) or the file holds no event (unreadable).", ("reason",))
            for reason in ("refused", "unreadable"):  # exported as 0 from the start: a panel or alert sees 0, not nothing
                self._failed.labels(reason)
            self._loop_errors = metrics.counter(
                "outbox_flush_errors", "Unexpected errors of the background flush, which goes on after each.")
        self._wake = asyncio.Event()
        self._seq = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None

    async def on_start(self) -> None:
        self._loop, self._loop_thread = asyncio.get_running_loop(), threading.get_ident()
        if self._files():
            self._wake.set()  # what an earlier run left goes out now, not after the first interval
        self._task = asyncio.create_task(self._flush_loop(), name="outbox-flush")

    async def on_stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        await self.flush()

    async def publish(self, topic: Topic, event: CloudEvent) -> bool:
        """Record ``event`` durably, then try to publish it now. False: it stays pending for the loop."""
        self._write(topic, event)
        return await self.flush()

    def record(self, topic: Topic, event: CloudEvent) -> None:
        """Record ``event`` durably (written and fsync'd before this returns) and leave publishing it
        to the background task (``start()``), which this wakes. Never waits for the broker. Safe to
        call from any thread (a synchronous core run with ``asyncio.to_thread``).

        Raises:
            OSError: the event could not be written (the disk is full or gone).
        """
        self._write(topic, event)
        if self._loop is None or self._loop_thread == threading.get_ident():
            self._wake.set()
        else:  # a synchronous core in a worker thread: asyncio.Event is not thread-safe
            self._loop.call_soon_threadsafe(self._wake.set)

    async def flush(self) -> bool:
        """Publish pending events oldest first; True when none is left.

        A failure that trying again may mend (the broker is down) stops the flush, so the events
        keep their order; an event the broker refused for good, or a file that holds no event, is
        moved aside and the flush goes on. A file gone meanwhile was sent by another flush.
        """
        async with self._lock:
            for path in self._files():
                try:
                    topic, event = _read(path)
                except FileNotFoundError:
                    self._done()
                    continue
                except Exception as exc:  # noqa: BLE001 - garbage, cut short, unreadable: never an event to send
                    if not self._set_aside(path, "unreadable", exc):
                        return False
                    continue
                try:
                    await self._publisher.publish(topic, event)
                except Exception as exc:  # noqa: BLE001 - the broker is down or slow: keep it for later
                    if not getattr(exc, "refused", False):  # PublishFailed.refused: the broker never takes it
                        log.warning("outbox: publish failed, will retry", extra={"error": str(exc), "event": event.id})
                        return False
                    if not self._set_aside(path, "refused", exc):
                        return False
                    continue
                path.unlink(missing_ok=True)
                self._done()
            return True

    def _set_aside(self, path: Path, reason: str, exc: Exception) -> bool:
        """Move ``path`` to the failed folder, where a person can look at it; logged and counted once.
        False when it cannot be moved (the disk is failing): it stays, and is tried again later."""
        target = self._failed_dir / path.name
        try:
            self._failed_dir.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
        except FileNotFoundError:
            pass  # sent and removed by another flush meanwhile
        except OSError as error:
            log.error("outbox: cannot move a failed event aside; will retry",
                      extra={"reason": reason, "error": str(error), "file": str(path)})
            return False
        else:
            log.error("outbox: event moved aside, never retried",
                      extra={"reason": reason, "error": str(exc), "file": str(target)})
            if self._failed is not None:
                self._failed.labels(reason).inc()
        self._done()
        return True

    def _done(self) -> None:
        if self._pending is not None:
            self._pending.dec()

    def _write(self, topic: Topic, event: CloudEvent) -> None:
        write_event(self._dir, topic, event, next(self._seq))
        if self._pending is not None:
            self._pending.inc()  # counted, not listed: listing per event made draining a backlog O(n^2)

    def _files(self) -> list[Path]:
        return sorted(self._dir.glob("*.json"))

    async def _flush_loop(self) -> None:
        """Flush when ``record`` wakes it, or every ``retry_interval_s``; after a failure, wait that long.
        An unexpected error is logged and counted, and the loop goes on: were it to end, no event
        recorded after would ever be published."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._retry_interval_s)
            self._wake.clear()
            try:
                if not self._files() or await self.flush():
                    continue
            except Exception:  # noqa: BLE001 - logged with its traceback; the events wait for the next try
                log.exception("outbox: the background flush failed; will retry")
                if self._loop_errors is not None:
                    self._loop_errors.inc()
            await asyncio.sleep(self._retry_interval_s)


def write_event(directory: Path, topic: Topic, event: CloudEvent, sequence: int) -> Path:
    """Write one event as an Outbox file (fsync'd, then renamed into place): what ``Outbox.flush``
    publishes. For writers without an Outbox (the tracer in a job, whose host's shipper publishes
    the folder); ``sequence`` orders events of one writer recorded in the same microsecond."""
    # the whole topic travels with the event: the outbox needs no list of the platform's topics
    record = {"topic": {"name": topic.name, "partitions": topic.partitions}, "data": event.data.hex(),
              "headers": [(k, v.decode("latin-1")) for k, v in event.kafka_headers()]}
    final = directory / f"{event.time.timestamp():020.6f}-{sequence:012d}-{event.id}.json"
    tmp = final.with_suffix(".tmp")
    with open(tmp, "w") as handle:
        json.dump(record, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, final)
    return final


def _read(path: Path) -> tuple[Topic, CloudEvent]:
    """The topic and event of a file ``write_event`` wrote.

    Raises:
        FileNotFoundError: the file is gone.
        OSError: it cannot be read.
        ValueError, KeyError, TypeError, AttributeError, MalformedEvent: it holds no such event.
    """
    record = json.loads(path.read_text())
    event = CloudEvent.from_kafka(
        [(k, v.encode("latin-1")) for k, v in record["headers"]], bytes.fromhex(record["data"]))
    return _topic(record["topic"]), event


def _topic(recorded: dict | str) -> Topic:
    """The topic a recorded event goes to (outboxes written before topics travelled whole held the name)."""
    return Topic(**recorded) if isinstance(recorded, dict) else Topic(recorded)
