"""Unit tests of the prediction log with a fake publisher: the request path never waits for the bus,
the queue is bounded, losses are counted, large messages become summaries, and what is queued for a
version goes out as one record (bounded by count and bytes, per version, never waiting to fill)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from opml.inference.v1 import events_pb2
from tritonclient.grpc import service_pb2 as pb

from opml_common.bus import PublishFailed
from opml_devstack.testing.bus import fresh_metrics, sample
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


OTHER = Routed(response=ROUTED.response, version="4", replica="w:2", attempts=1, backup_won=False)


def record(log: PredictionLog, request: bytes, request_id: str = "r", routed: Routed = ROUTED) -> None:
    log.record(request_id=request_id, model="m", routed=routed, request=request, response=routed.response,
               received=1_700_000_000.5, latency_s=0.002)


def predictions(message) -> list[events_pb2.PredictionMade]:
    return list(message.predictions) if isinstance(message, events_pb2.PredictionBatch) else [message]


async def settled(log: PredictionLog) -> None:
    """Until the senders have taken everything queued (each yield lets them run)."""
    while log.pending:
        await asyncio.sleep(0)


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
    made = [event for _, message, _ in publisher.published for event in predictions(message)]
    assert len(made) == 1000 - dropped
    topic, _, subject = publisher.published[0]
    assert topic == "opml.predictions.v1" and subject == "m/3"
    event = made[0]
    assert event.request_id == "r0" and event.model_version == "3" and event.latency_ms == pytest.approx(2.0)
    assert event.time.seconds == 1_700_000_000 and event.time.nanos == 500_000_000 and event.infer_request == request
    assert sample(registry, "opml_inference_router_predictions_published_total") == len(made)


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
    event = log.event_of(log.take()[0])
    assert not event.infer_request and event.infer_response == ROUTED.response
    summary = event.input_summaries[0]
    assert (summary.name, summary.datatype, list(summary.shape), summary.has_stats) == ("x", "FP32", [2, 256], True)
    assert (summary.mean, summary.min, summary.max) == (pytest.approx(255.5), 0.0, 511.0)
    assert summary.std == pytest.approx(float(values.std()))


def test_a_record_takes_what_is_queued_for_one_version_within_its_bounds() -> None:
    metrics, _ = fresh_metrics("inference-router")
    log = PredictionLog(FakePublisher(), metrics, batch_max=3, record_cap_bytes=1024)
    small = encode_request("m", {"x": np.ones((1, 4), np.float32)}).SerializeToString()
    for i in range(5):  # interleaved: m/3 gets a0..a4, m/4 gets b0..b4
        record(log, small, f"a{i}")
        record(log, small, f"b{i}", routed=OTHER)
    taken = [[e.request_id for e in log.take()] for _ in range(4)]
    # the version queued longest first, at most 3, then the other version (round robin), never mixed
    assert taken == [["a0", "a1", "a2"], ["b0", "b1", "b2"], ["a3", "a4"], ["b3", "b4"]]
    assert log.pending == 0 and log.take() == []

    each = log.recorded_bytes(_entry(log, small))  # one entry's recorded bytes
    bounded = PredictionLog(FakePublisher(), metrics, batch_max=100, batch_max_bytes=2 * each + each // 2,
                            record_cap_bytes=1024)
    for i in range(5):
        record(bounded, small, f"c{i}")
    assert [len(bounded.take()) for _ in range(3)] == [2, 2, 1], "bounded by bytes: 2.5 entries' worth a record"
    huge = PredictionLog(FakePublisher(), metrics, batch_max=100, batch_max_bytes=1, record_cap_bytes=1024)
    record(huge, small, "d0")
    record(huge, small, "d1")
    assert [len(huge.take()), len(huge.take())] == [1, 1], "an entry over the bound still goes, alone"


def _entry(log: PredictionLog, request: bytes):
    record(log, request, "probe")
    (entry,) = log.take()
    return entry


def test_one_entry_is_a_prediction_made_and_several_a_prediction_batch_in_order() -> None:
    metrics, _ = fresh_metrics("inference-router")
    log = PredictionLog(FakePublisher(), metrics, record_cap_bytes=64)
    small = encode_request("m", {"x": np.ones((1, 2), np.float32)}).SerializeToString()
    large = encode_request("m", {"x": np.arange(64, dtype=np.float32).reshape(1, 64)}).SerializeToString()
    record(log, small, "one")
    single = log.record_of(log.take())
    assert isinstance(single, events_pb2.PredictionMade) and single.request_id == "one"
    for i, request in enumerate([small, large, small]):
        record(log, request, f"r{i}")
    batch = log.record_of(log.take())
    assert isinstance(batch, events_pb2.PredictionBatch)
    assert [p.request_id for p in batch.predictions] == ["r0", "r1", "r2"]
    assert all(p.model_name == "m" and p.model_version == "3" and p.replica == "w:1" for p in batch.predictions)
    assert batch.predictions[0].infer_request == small and batch.predictions[0].time.nanos == 500_000_000
    assert not batch.predictions[1].infer_request and list(batch.predictions[1].input_summaries[0].shape) == [1, 64]


async def test_senders_publish_what_is_queued_now_without_waiting_to_fill_a_batch() -> None:
    metrics, registry = fresh_metrics("inference-router")
    publisher = FakePublisher()
    log = PredictionLog(publisher, metrics, senders=1, batch_max=100)
    request = encode_request("m", {"x": np.ones((1, 4), np.float32)}).SerializeToString()
    async with log:
        record(log, request, "first")
        await settled(log)  # the sender took "first" alone (a batch of one), and waits on the broker
        for i in range(3):
            record(log, request, f"next{i}")
        record(log, request, "other", routed=OTHER)
        assert log.pending == 4
        publisher.gate.set()
        while sample(registry, "opml_inference_router_predictions_published_total") < 5:
            await asyncio.sleep(0)
    records = [(subject, [p.request_id for p in predictions(message)], type(message).__name__)
               for _, message, subject in publisher.published]
    assert records == [("m/3", ["first"], "PredictionMade"), ("m/3", ["next0", "next1", "next2"], "PredictionBatch"),
                       ("m/4", ["other"], "PredictionMade")]
    failing = FakePublisher(fail=True)
    failing.gate.set()
    lossy = PredictionLog(failing, metrics, senders=1)
    async with lossy:
        for i in range(4):
            record(lossy, request, f"f{i}")
        while sample(registry, "opml_inference_router_predictions_dropped_total", reason="publish_failed") < 4:
            await asyncio.sleep(0)
    assert sample(registry, "opml_inference_router_predictions_dropped_total", reason="publish_failed") == 4, \
        "a refused batch counts each of its predictions"


async def test_a_version_has_at_most_its_in_flight_records_at_the_broker_so_its_predictions_batch() -> None:
    metrics, registry = fresh_metrics("inference-router")
    publisher = FakePublisher()
    log = PredictionLog(publisher, metrics, senders=4, in_flight_per_version=1)
    request = encode_request("m", {"x": np.ones((1, 4), np.float32)}).SerializeToString()
    async with log:
        record(log, request, "a0")
        await settled(log)  # a0's record is at the (stalled) broker
        for i in range(1, 6):
            record(log, request, f"a{i}")
        record(log, request, "b0", routed=OTHER)
        while log.pending > 5:  # b0 is taken: another version is not held back
            await asyncio.sleep(0)
        for _ in range(10):  # three senders are idle, yet m/3's five wait for its record in flight
            await asyncio.sleep(0)
        assert log.pending == 5 and len(publisher.published) == 0
        publisher.gate.set()
        while sample(registry, "opml_inference_router_predictions_published_total") < 7:
            await asyncio.sleep(0)
    by_version: dict[str, list[list[str]]] = {}
    for _, message, subject in publisher.published:
        by_version.setdefault(subject, []).append([p.request_id for p in predictions(message)])
    assert by_version == {"m/3": [["a0"], ["a1", "a2", "a3", "a4", "a5"]], "m/4": [["b0"]]}


async def test_lingering_predictions_leave_together_when_their_batch_is_full_when_due_or_when_stopping() -> None:
    """With ``linger_s`` a version's predictions wait to share a record (one producer send, one broker
    write, one ack): a full batch leaves at once, a part batch when its oldest has waited ``linger_s``
    or when the log stops; every prediction is published once, in order."""
    metrics, registry = fresh_metrics("inference-router")
    publisher = FakePublisher()
    publisher.gate.set()
    log = PredictionLog(publisher, metrics, senders=2, batch_max=4, linger_s=3600.0)
    request = encode_request("m", {"x": np.ones((1, 4), np.float32)}).SerializeToString()
    async with log:
        for i in range(6):
            record(log, request, f"a{i}")
        while log.pending > 2:  # four fill a record: it leaves without lingering
            await asyncio.sleep(0)
        for _ in range(10):  # idle senders, yet the other two wait for their hour (or the stop)
            await asyncio.sleep(0)
        assert log.pending == 2
    assert [[p.request_id for p in predictions(message)] for _, message, _ in publisher.published] == [
        ["a0", "a1", "a2", "a3"], ["a4", "a5"]]
    assert sample(registry, "opml_inference_router_predictions_published_total") == 6
    assert sample(registry, "opml_inference_router_predictions_dropped_total", reason="shutdown") == 0

    metrics, registry = fresh_metrics("inference-router")
    quiet = FakePublisher()
    quiet.gate.set()
    soon = PredictionLog(quiet, metrics, senders=1, linger_s=0.005)
    async with soon:
        record(soon, request, "alone")
        while sample(registry, "opml_inference_router_predictions_published_total") < 1:  # due: it leaves alone
            await asyncio.sleep(0.001)
    assert [(type(message).__name__, message.request_id) for _, message, _ in quiet.published] == [
        ("PredictionMade", "alone")]
