"""Unit tests of the prediction log with a fake publisher: the request path never waits for the bus,
the queue is bounded, losses are counted, large messages become summaries."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from opml_common.bus import PublishFailed
from opml_common.testing.bus import fresh_metrics, sample
from opml_inference_router.kserve import encode_request
from opml_inference_router.predictions import PredictionLog
from opml_inference_router.routing import Routed


class FakePublisher:
    """Stands in for EventPublisher: ``gate`` holds every publish until set; ``fail`` refuses them."""

    def __init__(self, *, fail: bool = False) -> None:
        self.gate = asyncio.Event()
        self.fail = fail
        self.published: list[tuple[str, object, str]] = []

    async def publish_proto(self, topic, message, *, subject: str):
        await self.gate.wait()
        if self.fail:
            raise PublishFailed("broker down", retriable=True)
        self.published.append((topic.name, message, subject))


ROUTED = Routed(response=pb.ModelInferResponse(model_name="m", model_version="3").SerializeToString(), version="3",
                replica="w:1", attempts=1, backup_won=False)


def record(log: PredictionLog, request: bytes, request_id: str = "r") -> None:
    log.record(request_id=request_id, model="m", routed=ROUTED, request=request, response=ROUTED.response,
               received=1_700_000_000.5, latency_s=0.002)


async def test_a_stalled_bus_never_blocks_requests_and_the_queue_is_bounded() -> None:
    metrics, registry = fresh_metrics("inference-router")
    publisher = FakePublisher()
    log = PredictionLog(publisher, metrics, max_pending=50, senders=2)
    request = encode_request("m", {"x": np.ones((1, 4), np.float32)}).SerializeToString()
    async with log:
        # No awaiting: the bus is stalled (the gate is shut), yet 1000 records return without the loop
        # running anything else in between (a callback scheduled before them has not run after them).
        ran = asyncio.Event()
        asyncio.get_running_loop().call_soon(ran.set)
        for i in range(1000):
            record(log, request, f"r{i}")
        assert not ran.is_set() and publisher.published == []
        assert log.pending <= 50
        dropped = sample(registry, "opml_inference_router_predictions_dropped_total", reason="queue_full")
        assert dropped >= 1000 - 50 - 2
        publisher.gate.set()

        async def drained() -> None:
            while log.pending:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(drained(), 30)  # a bound on failure only
    assert len(publisher.published) == 1000 - dropped
    topic, event, subject = publisher.published[0]
    assert topic == "opml.predictions.v1" and subject == "m/3"
    assert event.request_id == "r0" and event.model_version == "3" and event.latency_ms == pytest.approx(2.0)
    assert event.time.seconds == 1_700_000_000 and event.infer_request == request
    assert sample(registry, "opml_inference_router_predictions_published_total") == len(publisher.published)


async def test_publish_failures_and_shutdown_are_counted() -> None:
    metrics, registry = fresh_metrics("inference-router")
    publisher = FakePublisher(fail=True)
    publisher.gate.set()
    log = PredictionLog(publisher, metrics, senders=1)
    async with log:
        for i in range(5):
            record(log, b"", f"r{i}")
        for _ in range(100):
            if not log.pending:
                break
            await asyncio.sleep(0.01)
    assert sample(registry, "opml_inference_router_predictions_dropped_total", reason="publish_failed") == 5
    stuck = PredictionLog(FakePublisher(), metrics, senders=1)  # the broker never answers
    await stuck.start()
    record(stuck, b"", "a")
    record(stuck, b"", "b")
    await asyncio.sleep(0.01)
    await stuck.stop(drain_s=0.05)
    assert stuck.pending == 0
    assert sample(registry, "opml_inference_router_predictions_dropped_total", reason="shutdown") == 2


def test_bytes_held_are_bounded_and_large_messages_become_summaries() -> None:
    metrics, registry = fresh_metrics("inference-router")
    log = PredictionLog(FakePublisher(), metrics, max_pending_bytes=10_000, record_cap_bytes=1024)
    values = np.arange(512, dtype=np.float32).reshape(2, 256)
    request = encode_request("m", {"x": values}, request_id="big").SerializeToString()
    for _ in range(3):  # ~2.1 KiB each
        record(log, request)
    record(log, request * 2)  # would hold more than 10,000 bytes
    assert log.pending == 3
    assert sample(registry, "opml_inference_router_predictions_dropped_total", reason="queue_full") == 1
    event = log.event_of(log._queue[0])
    assert not event.infer_request and event.infer_response == ROUTED.response
    summary = event.input_summaries[0]
    assert (summary.name, summary.datatype, list(summary.shape), summary.has_stats) == ("x", "FP32", [2, 256], True)
    assert (summary.mean, summary.min, summary.max) == (pytest.approx(255.5), 0.0, 511.0)
    assert summary.std == pytest.approx(float(values.std()))
