"""Every prediction to the predictions topic, off the request path: a slow bus never slows a request.

The request path only appends to a bounded in-memory queue (:meth:`PredictionLog.record`, no await).
Background senders turn entries into ``opml.inference.v1.PredictionMade`` CloudEvents and publish
them to ``PREDICTIONS`` keyed by ``<model>/<version>``. When the queue is full (by entries or by
bytes held) or the broker refuses a record, the prediction is dropped and counted in
``opml_inference_router_predictions_dropped_total{reason}``, so memory stays bounded and the loss
is visible. Delivery is therefore at most once, by design: monitoring samples, it does not audit.

What is recorded: the KServe v2 request and response exactly as they crossed the router (wire
bytes, decodable with tritonclient's ``service_pb2``) when each is at most ``record_cap_bytes``
(default 64 KiB: a few thousand features, a small image); above the cap, per-tensor summaries
(datatype, shape, mean, std, min, max), computed by the sender, not by the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import NamedTuple

import numpy as np
from google.protobuf.timestamp_pb2 import Timestamp
from opml.inference.v1 import events_pb2
from tritonclient.grpc import service_pb2 as pb

from opml_common.bus import EventPublisher
from opml_common.metrics import ServiceMetrics
from opml_inference_router.kserve import BY_KSERVE
from opml_inference_router.routing import Routed
from opml_inference_router.topics import PREDICTIONS

log = logging.getLogger(__name__)


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


class PredictionLog:
    """The bounded queue and its senders.

    Side effects:
        ``start()``: starts ``senders`` background tasks (the publisher must be started by its
        owner). Idempotent.
        ``stop()``: lets the senders publish what is queued for up to ``drain_s``, then cancels
        them and counts what is left as dropped (``reason="shutdown"``). Idempotent.
    """

    def __init__(self, publisher: EventPublisher, metrics: ServiceMetrics, *, max_pending: int = 10_000,
                 max_pending_bytes: int = 64 * 1024 * 1024, record_cap_bytes: int = 64 * 1024,
                 senders: int = 8) -> None:
        if max_pending < 1 or max_pending_bytes < 1 or record_cap_bytes < 0 or senders < 1:
            raise ValueError(f"need max_pending >= 1, max_pending_bytes >= 1, record_cap_bytes >= 0, senders >= 1, "
                             f"but got {max_pending}, {max_pending_bytes}, {record_cap_bytes}, {senders}")
        self._publisher = publisher
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.record_cap_bytes = record_cap_bytes
        self._senders = senders
        self._queue: deque[_Entry] = deque()
        self._pending_bytes = 0
        self._sending = 0  # entries taken off the queue whose publish has not finished
        self._wakeup: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._dropped = metrics.counter("predictions_dropped_total",
                                        "Predictions not published: queue_full, publish_failed, shutdown.",
                                        ("reason",))
        self._published = metrics.counter("predictions_published_total", "Predictions the broker acknowledged.")
        metrics.gauge("predictions_pending", "Predictions queued for publishing.").set_function(
            lambda: len(self._queue))

    @property
    def pending(self) -> int:
        return len(self._queue)

    async def start(self) -> None:
        if self._tasks:
            return
        self._wakeup = asyncio.Event()
        self._tasks = [asyncio.create_task(self._send_forever(), name=f"predictions-sender-{i}")
                       for i in range(self._senders)]

    async def stop(self, *, drain_s: float = 5.0) -> None:
        if not self._tasks:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_s
        while (self._queue or self._sending) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._queue:
            self._dropped.labels("shutdown").inc(len(self._queue))
            self._queue.clear()
            self._pending_bytes = 0

    async def __aenter__(self) -> PredictionLog:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def record(self, *, request_id: str, model: str, routed: Routed, request: bytes, response: bytes,
               received: float, latency_s: float) -> None:
        """Queue one prediction (never blocks, never raises); dropped and counted when the queue is full."""
        entry = _Entry(request_id, model, received, latency_s, routed, request, response)
        if len(self._queue) >= self.max_pending or self._pending_bytes + entry.size > self.max_pending_bytes:
            self._dropped.labels("queue_full").inc()
            return
        self._queue.append(entry)
        self._pending_bytes += entry.size
        if self._wakeup is not None:
            self._wakeup.set()

    async def _send_forever(self) -> None:
        assert self._wakeup is not None
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            entry = self._queue.popleft()
            self._sending += 1
            try:
                message = self.event_of(entry)
                await self._publisher.publish_proto(PREDICTIONS, message,
                                                    subject=f"{entry.model}/{entry.routed.version}")
            except asyncio.CancelledError:
                self._dropped.labels("shutdown").inc()
                raise
            except Exception as exc:  # noqa: BLE001 - a lost prediction is counted, never fatal
                self._dropped.labels("publish_failed").inc()
                log.warning("prediction not published: %s", exc)
            else:
                self._published.inc()
            finally:
                self._sending -= 1
                self._pending_bytes -= entry.size

    def event_of(self, entry: _Entry) -> events_pb2.PredictionMade:
        """The PredictionMade event of one entry: raw messages within the cap, else summaries."""
        routed = entry.routed
        event = events_pb2.PredictionMade(
            request_id=entry.request_id, model_name=entry.model, model_version=routed.version,
            latency_ms=entry.latency_s * 1000.0, replica=routed.replica, backup_won=routed.backup_won,
            attempts=routed.attempts, time=_timestamp(entry.received))
        if len(entry.request) <= self.record_cap_bytes:
            event.infer_request = entry.request
        else:
            request = pb.ModelInferRequest.FromString(entry.request)
            event.input_summaries.extend(_summaries(request.inputs, request.raw_input_contents))
        if len(entry.response) <= self.record_cap_bytes:
            event.infer_response = entry.response
        else:
            response = pb.ModelInferResponse.FromString(entry.response)
            event.output_summaries.extend(_summaries(response.outputs, response.raw_output_contents))
        return event


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def _summaries(tensors, raw_contents) -> list[events_pb2.TensorSummary]:
    """Per tensor: datatype, shape, and statistics of numeric values (raw or typed contents)."""
    summaries = []
    for index, tensor in enumerate(tensors):
        summary = events_pb2.TensorSummary(name=tensor.name, datatype=tensor.datatype, shape=list(tensor.shape))
        datatype = BY_KSERVE.get(tensor.datatype)
        if datatype is not None and datatype.kserve != "BYTES":
            try:
                if index < len(raw_contents):
                    values = np.frombuffer(raw_contents[index], dtype=datatype.numpy)
                elif datatype.contents_field is not None:
                    values = np.asarray(getattr(tensor.contents, datatype.contents_field), dtype=datatype.numpy)
                else:
                    values = np.empty(0)
                values = values.astype(np.float64)
            except ValueError:  # contents that do not match the datatype: no statistics
                values = np.empty(0)
            if values.size:
                summary.has_stats = True
                summary.mean, summary.std = float(values.mean()), float(values.std())
                summary.min, summary.max = float(values.min()), float(values.max())
        summaries.append(summary)
    return summaries
