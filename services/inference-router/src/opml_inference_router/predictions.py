"""Every prediction to the predictions topic, off the request path: a slow bus never slows a request.

The request path only appends to a bounded in-memory queue (:meth:`PredictionLog.record`, no await),
one line per model version. A version's line may be taken once its oldest prediction has waited
``linger_s`` (the service's default: 50 ms) or it holds ``batch_max`` predictions, as Kafka's
``linger.ms`` does: without it, a router below a few thousand requests a second published about one
record per request (every record a producer send, a broker write and an ack on the cores that serve),
about a third of the router's event loop at 8 callers (docs/benchmarks.md, serving tail). Background
senders each take what is queued for one version at that moment (the version queued longest that may
be taken and has fewer than ``in_flight_per_version`` records at the broker, its oldest first; at most
``batch_max`` predictions and ``batch_max_bytes`` of recorded messages) and publish it as one record to
``PREDICTIONS``, keyed by ``<model>/<version>``: an ``opml.inference.v1.PredictionMade`` CloudEvent
when they took one, an ``opml.inference.v1.PredictionBatch`` of them when they took several. A
consumer's costs are per record, so records carry about rate x ``linger_s`` predictions, more when a
version's predictions come faster than its ``in_flight_per_version`` records are acknowledged (about
rate x ack latency / in-flight), and a quiet router still publishes a request's PredictionMade within
``linger_s``. When the queue is full (by entries or by bytes held) or the broker refuses a record, its
predictions are dropped and counted in ``opml_inference_router_predictions_dropped_total{reason}``,
so memory stays bounded and the loss is visible. Delivery is therefore at most once, by design:
monitoring samples, it does not audit.

What is recorded (each prediction built by the contract's
:func:`~opml_inference_router_contract.predictions.prediction_made`, so whoever publishes in the
router's stead makes the same events): the KServe v2 request and response exactly as they crossed the
router (wire bytes, decodable with tritonclient's ``service_pb2``) when each is at most
``record_cap_bytes`` (default 64 KiB: a few thousand features, a small image); above the cap, per-tensor
summaries (datatype, shape, mean, std, min, max), computed by the sender, not by the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import NamedTuple

from opml.inference.v1 import events_pb2

from opml_common.bus import EventPublisher
from opml_common.lifecycle import Component, cancel_and_wait
from opml_common.metrics import ServiceMetrics
from opml_inference_router.routing import Routed
from opml_inference_router_contract.predictions import RECORD_CAP_BYTES, prediction_made, prediction_subject
from opml_inference_router_contract.topics import PREDICTIONS

log = logging.getLogger(__name__)


RECORD_OVERHEAD_BYTES = 256
"""What a prediction adds to a record besides its recorded KServe messages (ids, times, summaries), for
the ``batch_max_bytes`` bound."""


class _Entry(NamedTuple):
    request_id: str
    model: str
    received: float
    latency_s: float
    routed: Routed
    request: bytes
    response: bytes

    @property
    def size(self) -> int:
        return len(self.request) + len(self.response)


class PredictionLog(Component):
    """The bounded queue and its senders.

    Side effects:
        ``start()``: starts ``senders`` background tasks (the publisher must be started by its
        owner). Idempotent.
        ``stop()``: lets the senders publish what is queued (lingering no more) for up to ``drain_s``,
        then cancels them and counts what is left as dropped (``reason="shutdown"``). Idempotent.
    """

    def __init__(self, publisher: EventPublisher, metrics: ServiceMetrics, *, max_pending: int = 10_000,
                 max_pending_bytes: int = 64 * 1024 * 1024, record_cap_bytes: int = RECORD_CAP_BYTES,
                 senders: int = 8, batch_max: int = 100, batch_max_bytes: int = 512 * 1024,
                 in_flight_per_version: int = 4, linger_s: float = 0.0) -> None:
        if (max_pending < 1 or max_pending_bytes < 1 or record_cap_bytes < 0 or senders < 1 or batch_max < 1
                or batch_max_bytes < 1 or in_flight_per_version < 1 or not linger_s >= 0):
            raise ValueError(f"need max_pending >= 1, max_pending_bytes >= 1, record_cap_bytes >= 0, senders >= 1, "
                             f"batch_max >= 1, batch_max_bytes >= 1, in_flight_per_version >= 1, linger_s >= 0, but "
                             f"got {max_pending}, {max_pending_bytes}, {record_cap_bytes}, {senders}, {batch_max}, "
                             f"{batch_max_bytes}, {in_flight_per_version}, {linger_s}")
        super().__init__()
        self._publisher = publisher
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.record_cap_bytes = record_cap_bytes
        self.batch_max = batch_max
        self.batch_max_bytes = batch_max_bytes
        self.in_flight_per_version = in_flight_per_version
        self.linger_s = linger_s
        self._senders = senders
        # "<model>/<version>" -> its queued entries, oldest first; in the order the versions are served
        # (a version taken from goes to the back if it has more)
        self._queues: dict[str, deque[_Entry]] = {}
        self._due: dict[str, float] = {}  # "<model>/<version>" -> when its line may be taken (time.monotonic)
        self._lingering = linger_s > 0  # False while stopping: what is queued leaves at once
        self._in_flight: dict[str, int] = {}  # "<model>/<version>" -> its records being published
        self._pending = 0
        self._pending_bytes = 0
        self._sending = 0  # entries taken off the queue whose publish has not finished
        self._idle: list[asyncio.Future] = []  # senders waiting for something to take, each woken alone
        self._tasks: list[asyncio.Task] = []
        self._drain_s = 5.0  # what the running stop() was given
        self._dropped = metrics.counter("predictions_dropped_total",
                                        "Predictions not published: queue_full, publish_failed, shutdown.",
                                        ("reason",))
        self._published = metrics.counter("predictions_published_total", "Predictions the broker acknowledged.")
        metrics.gauge("predictions_pending", "Predictions queued for publishing.").set_function(
            lambda: self._pending)

    @property
    def pending(self) -> int:
        return self._pending

    async def on_start(self) -> None:
        self._tasks = [asyncio.create_task(self._send_forever(), name=f"predictions-sender-{i}")
                       for i in range(self._senders)]

    async def stop(self, *, drain_s: float = 5.0) -> None:
        self._drain_s = drain_s
        await super().stop()

    async def on_stop(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._drain_s
        self._lingering = False
        for _ in self._queues:
            self._wake_one()
        while (self._pending or self._sending) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(*tasks)
        if self._pending:
            self._dropped.labels("shutdown").inc(self._pending)
            self._queues.clear()
            self._due.clear()
            self._pending = self._pending_bytes = 0

    def record(self, *, request_id: str, model: str, routed: Routed, request: bytes, response: bytes,
               received: float, latency_s: float) -> None:
        """Queue one prediction (never blocks, never raises); dropped and counted when the queue is full."""
        entry = _Entry(request_id, model, received, latency_s, routed, request, response)
        if self._pending >= self.max_pending or self._pending_bytes + entry.size > self.max_pending_bytes:
            self._dropped.labels("queue_full").inc()
            return
        key = prediction_subject(model, routed.version)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
        queue.append(entry)
        self._pending += 1
        self._pending_bytes += entry.size
        if len(queue) == 1 and self._lingering:  # its line may be taken in linger_s: a sender is woken then
            self._due[key] = time.monotonic() + self.linger_s
            asyncio.get_running_loop().call_later(self.linger_s, self._wake_one)
            return
        # one sender woken when the version has something to take for the first time (or, lingering, a
        # full batch); while it has, a sender was woken for it already, or one of its own returns for
        # more (see sent())
        if ((len(queue) == 1 or (self._lingering and len(queue) == self.batch_max))
                and self._in_flight.get(key, 0) < self.in_flight_per_version):
            self._wake_one()

    def _wake_one(self) -> None:
        while self._idle:
            waiter = self._idle.pop()
            if not waiter.done():
                waiter.set_result(None)
                return

    def take(self) -> list[_Entry]:
        """What is queued now for one version, to publish as one record: the version queued longest
        that has fewer than ``in_flight_per_version`` records being published, its oldest entries
        first, at most ``batch_max`` of them and ``batch_max_bytes`` recorded bytes (always at least
        one); never waits for more. A version with entries left goes to the back of the line, so a
        busy version does not hold back the others. Empty when nothing can be taken. The caller
        publishes the record and then calls :meth:`sent` with it.

        The in-flight bound is what makes batches form: while a version's records are at the broker,
        its new predictions queue up and the next record takes them all (about rate x ack latency /
        ``in_flight_per_version`` a record), where free senders would otherwise publish them one by
        one (a consumer pays per record). With ``linger_s``, a version's line is taken only once its
        oldest prediction waited that long or it holds ``batch_max`` (or while stopping)."""
        cap = self.in_flight_per_version
        if self._lingering:
            now = time.monotonic()
            key = next((k for k, queue in self._queues.items() if self._in_flight.get(k, 0) < cap
                        and (self._due.get(k, 0.0) <= now or len(queue) >= self.batch_max)), None)
        else:
            key = next((k for k in self._queues if self._in_flight.get(k, 0) < cap), None)
        if key is None:
            return []
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        queue = self._queues.pop(key)
        taken = [queue.popleft()]
        size = self.recorded_bytes(taken[0])
        while queue and len(taken) < self.batch_max:
            following = self.recorded_bytes(queue[0])
            if size + following > self.batch_max_bytes:
                break
            taken.append(queue.popleft())
            size += following
        if queue:  # a backlog keeps its line's due time
            self._queues[key] = queue
        else:
            self._due.pop(key, None)
        self._pending -= len(taken)
        if self._queues:  # more to take, maybe: the next idle sender looks (at most one wake a take)
            self._wake_one()
        return taken

    def sent(self, entries: list[_Entry]) -> None:
        """A record from :meth:`take` is published (or failed): its version may take another."""
        first = entries[0]
        key = prediction_subject(first.model, first.routed.version)
        left = self._in_flight.pop(key) - 1
        if left:
            self._in_flight[key] = left
        if key in self._queues:
            self._wake_one()

    def recorded_bytes(self, entry: _Entry) -> int:
        """About what the entry adds to a record: its KServe messages within the cap, and the rest."""
        cap = self.record_cap_bytes
        return ((len(entry.request) if len(entry.request) <= cap else 0)
                + (len(entry.response) if len(entry.response) <= cap else 0) + RECORD_OVERHEAD_BYTES)

    async def _send_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            entries = self.take()
            if not entries:
                waiter = loop.create_future()
                self._idle.append(waiter)
                try:
                    await waiter
                finally:
                    with contextlib.suppress(ValueError):  # cancelled while idle
                        self._idle.remove(waiter)
                continue
            self._sending += len(entries)
            try:
                first = entries[0]
                await self._publisher.publish_proto(PREDICTIONS, self.record_of(entries),
                                                    subject=prediction_subject(first.model, first.routed.version))
            except asyncio.CancelledError:
                self._dropped.labels("shutdown").inc(len(entries))
                raise
            except Exception as exc:  # noqa: BLE001 - a lost prediction is counted, never fatal
                self._dropped.labels("publish_failed").inc(len(entries))
                log.warning("%d prediction(s) not published: %s", len(entries), exc)
            else:
                self._published.inc(len(entries))
            finally:
                self._sending -= len(entries)
                self._pending_bytes -= sum(entry.size for entry in entries)
                self.sent(entries)

    def record_of(self, entries: list[_Entry]) -> events_pb2.PredictionMade | events_pb2.PredictionBatch:
        """The record of entries of one version: its PredictionMade if one, else a PredictionBatch of them."""
        if len(entries) == 1:
            return self.event_of(entries[0])
        batch = events_pb2.PredictionBatch()
        for entry in entries:
            self._fill(batch.predictions.add(), entry)
        return batch

    def event_of(self, entry: _Entry) -> events_pb2.PredictionMade:
        """The PredictionMade event of one entry: raw messages within the cap, else summaries."""
        return self._fill(events_pb2.PredictionMade(), entry)

    def _fill(self, event: events_pb2.PredictionMade, entry: _Entry) -> events_pb2.PredictionMade:
        routed = entry.routed
        return prediction_made(request_id=entry.request_id, model=entry.model, version=routed.version,
                               request=entry.request, response=entry.response, received=entry.received,
                               latency_s=entry.latency_s, replica=routed.replica, attempts=routed.attempts,
                               backup_won=routed.backup_won, record_cap_bytes=self.record_cap_bytes, into=event)
