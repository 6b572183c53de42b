"""The stream's decode of its source records (no broker): a PredictionBatch record gives the rows of its
predictions published one per record, decoded together; a record with a bad prediction, of another
version or of an unknown one is rejected whole; predictions of other layouts in one record still decode."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
from opml.inference.v1 import events_pb2
from opml.monitoring.v1.label_events_pb2 import LabelObserved
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2 as pb

from opml_common.bus import UntrustedSource
from opml_common.bus.cloudevents import CloudEvent
from opml_common.config import PlatformSettings
from opml_common.errors import InvalidArgument
from opml_common.events import RecordingEmitter
from opml_common.kserve_codec import encode_outputs, encode_request
from opml_common.metrics import ServiceMetrics
from opml_inference_router_contract.names import EVENT_SOURCE as ROUTER_SOURCE
from opml_monitoring_scorer.core.decode import Batch
from opml_monitoring_scorer.core.reference import Task
from opml_monitoring_scorer.core.scorer import Scorer, dump_reference
from opml_monitoring_scorer.metrics import ScorerMetrics
from opml_monitoring_scorer.state import LabelOrigin, MonitorStore
from opml_monitoring_scorer.stream import DecodedRecord, ScoringStream, UnknownModel
from opml_monitoring_scorer.synthetic import SyntheticWorld
from opml_monitoring_scorer_contract.names import LABEL_SOURCE

CONFIG = b"features: {x: [x0, x1, x2, x3]}\nwindow: {count: 100}\n"


def prediction(i: int, rows: int = 1, *, version: str = "1", color: bool = True, text: bool = False,
               classes: int = 2) -> events_pb2.PredictionMade:
    """One-row (or ``rows``) request; ``text``: its x tensor BYTES; ``classes``: how many scores per row."""
    rng = np.random.default_rng(i)
    p = rng.uniform(size=(rows, 1)).astype(np.float32)
    inputs = {"x": np.array([[b"a"] * 4] * rows, dtype=object) if text else rng.normal(size=(rows, 4)).astype(np.float32)}
    if color:
        inputs["color"] = np.array([[b"red"]] * rows, dtype=object)
    request = encode_request("m", inputs, request_id=f"r{i}")
    scores = np.hstack([1 - p, p, *[np.zeros_like(p)] * (classes - 2)])
    response = encode_outputs(pb.ModelInferResponse(id=f"r{i}"), {"probabilities": scores})
    made = events_pb2.PredictionMade(request_id=f"r{i}", model_name="m", model_version=version,
                                     infer_request=request.SerializeToString(),
                                     infer_response=response.SerializeToString())
    made.time.FromNanoseconds(1_700_000_000_000_000_000 + i * 1_000_000)
    return made


def record(message, offset: int) -> SimpleNamespace:
    """A faust event as the stream sees it: its message (headers, value, position)."""
    event = CloudEvent.from_proto(message, source=ROUTER_SOURCE, subject="m/1")
    return SimpleNamespace(message=SimpleNamespace(
        value=event.data, headers=event.kafka_headers(), timestamp=1_700_000_000.0, partition=0, offset=offset,
        topic="opml.predictions.v1", key=b"m/1"))


def batch_of(*predictions: events_pb2.PredictionMade) -> events_pb2.PredictionBatch:
    return events_pb2.PredictionBatch(predictions=list(predictions))


@pytest.fixture
def files() -> dict[str, bytes]:
    world = SyntheticWorld(Task.BINARY, seed=5)
    return {"reference.npz": dump_reference(world.reference(500)), "monitoring.yaml": CONFIG}


@pytest.fixture
async def stream(tmp_path: Path, files: dict[str, bytes]):
    async def load(context: str, ref: str):
        return "uuid-1", files

    client = aioredis.Redis.from_url("redis://127.0.0.1:6379")
    prefix = f"opml-test:{uuid.uuid4().hex[:8]}:"
    metrics = ScorerMetrics(ServiceMetrics("monitoring-scorer", CollectorRegistry()))
    scorer = Scorer(store=MonitorStore(client, prefix=prefix, retention_s=600), emitter=RecordingEmitter(),
                    metrics=metrics, load_bundle=load)
    await scorer.register("m", "1", "ctx", "ref")
    yield ScoringStream(PlatformSettings(), scorer, metrics, publisher=None, datadir=tmp_path)
    keys = await client.keys(prefix + "*")
    if keys:
        await client.delete(*keys)
    await client.aclose()


def decode_records(stream: ScoringStream, events: list) -> list:
    """What the stream's batch step decodes of these records: per record a DecodedRecord, or the
    exception that dead-letters it."""
    return stream._decode_parsed(events, [stream._parsed(event) for event in events])


def rows_of(item: DecodedRecord) -> Batch:
    return Batch.concat([batch.rows(start, stop) for batch, start, stop in item.parts],
                        summary_only=item.summary_only)


def same_rows(got: Batch, expected: Batch) -> None:
    assert got.request_ids == expected.request_ids and got.summary_only == expected.summary_only
    assert sorted(got.features) == sorted(expected.features)
    for name, column in expected.features.items():
        assert got.features[name].tolist() == column.tolist()
    assert got.outputs.scores.tolist() == expected.outputs.scores.tolist()


def test_a_batch_record_decodes_to_the_rows_of_its_predictions_one_per_record(stream) -> None:
    made = [prediction(0), prediction(1, rows=3), events_pb2.PredictionMade(request_id="s", model_name="m",
                                                                           model_version="1"), prediction(3)]
    singles = decode_records(stream, [record(p, i) for i, p in enumerate(made)])
    expected = Batch.concat([rows_of(item) for item in singles])
    # one batch record among single ones: decoded together, its rows one range, in the record's order
    batched = decode_records(stream, [record(prediction(9), 0), record(batch_of(*made), 1), record(prediction(8), 2)])
    assert all(isinstance(item, DecodedRecord) for item in batched)
    item = batched[1]
    assert (item.key, item.counts, item.rows, item.summary_only, item.weight) == ("m/1", [1, 3, 0, 1], 5, 1, 6)
    assert len(item.parts) == 1 and item.parts[0][1:] == (1, 6), "rows 1-5 of the take's decode (row 0 is r9's)"
    same_rows(rows_of(item), expected)
    assert (item.first, item.last) == (1_700_000_000.0, 1_700_000_000.003)
    joinable = item.joinable()
    assert [request_id for _, request_id in joinable] == ["r0", "r1", "r3"], "summary-only rows join nothing"
    assert [events_pb2.PredictionMade.FromString(raw) for raw, _ in joinable] == [made[0], made[1], made[3]]
    assert batched[0].joinable() == [(prediction(9).SerializeToString(), "r9")], "a PredictionMade's own bytes"


def test_a_batch_of_mixed_layouts_decodes_prediction_by_prediction(stream) -> None:
    made = [prediction(0), prediction(1, color=False), prediction(2)]  # the second lacks the color tensor
    (item,) = decode_records(stream, [record(batch_of(*made), 0)])
    assert isinstance(item, DecodedRecord) and len(item.parts) == 3 and item.rows == 3
    rows = rows_of(item)
    assert rows.request_ids == ["r0", "r1", "r2"] and [c == "red" for c in rows.features["color"]] == [True, False, True]


def test_a_record_with_a_bad_prediction_or_of_other_versions_is_rejected_whole(stream) -> None:
    bad = prediction(1)
    bad.infer_request = bad.infer_request[:-3]
    items = decode_records(stream, [
        record(batch_of(prediction(0), bad), 0),                          # one prediction does not decode
        record(batch_of(prediction(2), prediction(3, version="2")), 1),   # two versions in one record
        record(batch_of(prediction(4, version="7"), prediction(5, version="7")), 2),  # nobody monitors 7
        record(events_pb2.PredictionBatch(), 3),                          # empty
        record(batch_of(prediction(6), prediction(7)), 4)])               # fine, beside them
    assert isinstance(items[0], InvalidArgument) and items[0].field.startswith("predictions[1].infer_request")
    assert isinstance(items[1], InvalidArgument) and items[1].field == "predictions[1]"
    assert isinstance(items[2], UnknownModel) and items[2].predictions == 2  # counted as skipped, not dead-lettered
    assert isinstance(items[3], InvalidArgument) and items[3].field == "predictions"
    assert isinstance(items[4], DecodedRecord) and rows_of(items[4]).request_ids == ["r6", "r7"]
    for key in (b"r8", None):  # keyed by request id, or not at all: the version's records spread over partitions
        stray = record(prediction(8), 6)
        stray.message.key = key
        (rejected,) = decode_records(stream, [stray])
        assert isinstance(rejected, InvalidArgument) and rejected.field == "key", rejected
    wrong = record(events_pb2.PredictionMade(), 5)
    wrong.message.headers = [(k, b"opml.inference.v1.Other" if k == "ce_type" else v)
                             for k, v in wrong.message.headers]
    (rejected,) = decode_records(stream, [wrong])
    assert isinstance(rejected, InvalidArgument) and rejected.field == "ce_type"


def test_a_record_that_disagrees_with_the_reference_is_rejected_with_the_reason(stream) -> None:
    """Text where the reference's features are numbers, or scores of three classes for a binary model,
    decode; they are rejected when they come, not when their window's estimators fail."""
    items = decode_records(stream, [record(prediction(0), 0), record(prediction(1, text=True), 1),
                                    record(prediction(2, classes=3), 2),
                                    record(batch_of(prediction(3), prediction(4, text=True)), 3),
                                    record(prediction(5), 4)])
    assert isinstance(items[1], InvalidArgument) and items[1].field == "features.x0"
    assert "is categorical, but the reference's is numeric" in str(items[1])
    assert isinstance(items[2], InvalidArgument) and items[2].field == "infer_response.outputs"
    assert "scores of 3 classes, but the reference's have 2" in str(items[2])
    assert isinstance(items[3], InvalidArgument) and items[3].field == "predictions[1].features.x0"
    assert [rows_of(items[i]).request_ids for i in (0, 4)] == [["r0"], ["r5"]]


class Table:
    """The ``windows`` table as the stream's close uses it: a dict, and a changelog send."""

    def __init__(self) -> None:
        self.data: dict = {}
        self.changelog_topic = self
        self.key_serializer = self.value_serializer = None

    def get(self, key: str):
        return self.data.get(key)

    async def send(self, **kwargs):
        sent = asyncio.get_running_loop().create_future()
        sent.set_result(None)
        return sent


class Publisher:
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []

    async def send_raw(self, topic: str, value: bytes, *, key: bytes, headers: list) -> None:
        self.sent.append((topic, dict(headers)))


@pytest.mark.parametrize("files", [{"monitoring.yaml": b"window: {count: 10}\n"}])
async def test_a_window_that_cannot_be_scored_is_dead_lettered_and_the_version_scores_on(stream) -> None:
    """No reference to check records against as they come: the first window mixes scores of two and
    three classes, which no estimator can read. It used to raise at every close (the agent crashed, was
    fed the same records again, and crashed again): now its records are dead-lettered with the reason
    and the next window is scored."""
    acked: list[int] = []
    events = []
    for i in range(20):
        event = record(prediction(i, classes=3 if 5 <= i < 10 else 2), i)
        event.message.generation_id = 1
        event.ack = lambda offset=i: acked.append(offset)
        events.append(event)
    stream.app = SimpleNamespace(flow_control=SimpleNamespace(is_active=lambda: True), consumer_generation_id=1)
    stream.windows = Table()
    stream.publisher = publisher = Publisher()
    await stream._on_batch(events)
    assert [topic for topic, _ in publisher.sent] == ["opml.predictions.v1.dlq"] * 10
    assert [int(h["opml_source_offset"]) for _, h in publisher.sent] == list(range(10))
    assert all(b"window 0 of m/1 cannot be scored" in h["opml_error"] for _, h in publisher.sent)
    assert await stream.scorer.store.get_window("m/1", 0) is None
    assert (await stream.scorer.store.get_window("m/1", 1))["rows"] == 10, "the next window is scored"
    assert stream.windows.data["m/1"] == {"index": 2, "partition": 0, "through": 19}
    assert acked == list(range(20))


async def test_a_label_is_retried_while_redis_is_away_and_a_malformed_one_dead_lettered(stream) -> None:
    """A label whose join failed for a reason that may pass (Redis unreachable) used to be dead-lettered
    as malformed; now it is tried again until it is applied, with the labels after it in its batch (in
    their order). It is applied as its event's source's; one the scorer refuses as untrusted is
    dead-lettered as such and counted apart from malformed ones. The batch's events are acked once
    each, after every label is applied or dead-lettered."""
    stream.publisher = publisher = Publisher()
    replies: list[object] = [
        redis.exceptions.ConnectionError("Redis went away"),  # the whole batch
        ["joined", TimeoutError(), "joined"],  # from the second on, again
        [InvalidArgument("values", "must hold 1-100000 values, but holds 0"),
         UntrustedSource("label source 'evil/anyone' is not a label producer of m/1")]]
    calls: list[list[tuple[bytes, LabelOrigin]]] = []

    async def on_labels(items: list[tuple[bytes, LabelOrigin]]) -> list[object]:
        calls.append(list(items))
        reply = replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    stream.scorer.on_labels = on_labels
    acked: list[int] = []
    events = []
    for offset in range(3):
        event = record(LabelObserved(request_id=f"r{offset}", values=[1.0]), offset)
        event.ack = lambda offset=offset: acked.append(offset)
        events.append(event)
    await stream._on_labels(events)
    assert [len(items) for items in calls] == [3, 3, 2], "retried whole, then from the label that failed"
    assert calls[0][0][1].producer == ROUTER_SOURCE, "as its event's source's"
    assert [LabelObserved.FromString(raw).request_id for raw, _ in calls[2]] == ["r1", "r2"]
    assert [(topic, h["opml_error_type"], h["opml_source_offset"]) for topic, h in publisher.sent] == [
        ("opml.labels.v1.dlq", b"InvalidArgument", b"1"), ("opml.labels.v1.dlq", b"UntrustedSource", b"2")]
    assert acked == [0, 1, 2]
    (metric,) = stream.metrics.labels.collect()
    counted = {s.labels["outcome"]: s.value for s in metric.samples if s.name.endswith("_total")}
    assert (counted["malformed"], counted["untrusted"]) == (1, 1)


def running(stream: ScoringStream, count: int) -> list:
    """``count`` records (request ids r0..) of partition 0 from offset 0, and ``stream`` as the running agent
    sees its app (flowing, one generation) and its windows table."""
    events = []
    for i in range(count):
        event = record(prediction(i), i)
        event.message.generation_id = 1
        event.ack = lambda: None
        events.append(event)
    stream.app = SimpleNamespace(flow_control=SimpleNamespace(is_active=lambda: True), consumer_generation_id=1)
    stream.windows = Table()
    return events


async def test_predictions_whose_label_join_failed_are_kept_for_the_join_at_the_next_flush(stream) -> None:
    """Redis going away while a batch's predictions were kept for the label join: they were dropped
    (their records stay in the open window, so nothing feeds them again) and a label parked for one
    of them was never applied. They stay pending, and the next batch's flush applies them."""
    events = running(stream, 8)
    scorer = stream.scorer
    label = LabelObserved(request_id="r0", values=[1.0]).SerializeToString()
    assert await scorer.on_label(label, LabelOrigin(LABEL_SOURCE, datetime(2026, 1, 1, tzinfo=UTC), "e0")) == "parked"
    calls: list[list[str]] = []
    join = scorer.on_predictions_joinable

    async def on_predictions_joinable(items) -> None:
        calls.append([item.request_id for item in items])
        if len(calls) == 1:
            raise redis.exceptions.ConnectionError("Redis went away")
        await join(items)

    scorer.on_predictions_joinable = on_predictions_joinable
    with pytest.raises(redis.exceptions.ConnectionError):
        await stream._on_batch(events[:5])
    await stream._on_batch(events[5:])
    assert calls == [[f"r{i}" for i in range(5)], [f"r{i}" for i in range(8)]]
    assert (await scorer.store.truth("m/1", 0))[0] == 1, "the parked label joined"
    assert await scorer.store.find_prediction("r4") is not None


async def test_the_predictions_agent_waits_out_a_redis_outage_instead_of_crashing_and_raises_anything_else(
        stream) -> None:
    """A batch that stopped on an error that may pass (Redis unreachable) no longer raises out of the agent
    (faust restarted it on every batch, and stops the app past 100 restarts a second): the agent backs off
    and takes the next batch, whose flush applies the kept joins. Any other error still raises."""
    events = running(stream, 9)
    scorer = stream.scorer
    calls: list[list[str]] = []
    join = scorer.on_predictions_joinable

    async def on_predictions_joinable(items) -> None:
        calls.append([item.request_id for item in items])
        if len(calls) <= 2:
            raise redis.exceptions.ConnectionError("Redis went away")
        await join(items)

    async def batches(*parts):
        for part in parts:
            yield part

    scorer.on_predictions_joinable = on_predictions_joinable
    await stream._take_predictions(batches(events[:3], events[3:5], events[5:8]))
    assert calls == [[f"r{i}" for i in range(3)], [f"r{i}" for i in range(5)], [f"r{i}" for i in range(8)]]
    assert await scorer.store.find_prediction("r7") is not None

    async def broken(items) -> None:
        raise ValueError("a defect, not an outage")

    scorer.on_predictions_joinable = broken
    with pytest.raises(ValueError, match="a defect"):
        await stream._take_predictions(batches(events[8:]))


async def test_a_batch_of_labels_that_fails_as_a_whole_is_applied_one_by_one(stream) -> None:
    """An error of a whole batch that will not pass by retrying (not one label's outcome) is met by
    applying its labels one at a time: only the label that causes it is dead-lettered, not its batch."""
    stream.publisher = publisher = Publisher()
    calls: list[list[str]] = []

    async def on_labels(items: list[tuple[bytes, LabelOrigin]]) -> list[object]:
        ids = [LabelObserved.FromString(raw).request_id for raw, _ in items]
        calls.append(ids)
        if "bad" in ids:
            raise ValueError("a label the join cannot read")
        return ["joined"] * len(items)

    stream.scorer.on_labels = on_labels
    events = [record(LabelObserved(request_id=request_id, values=[1.0]), offset)
              for offset, request_id in enumerate(["r0", "bad", "r2"])]
    acked: list[int] = []
    for offset, event in enumerate(events):
        event.ack = lambda offset=offset: acked.append(offset)
    await stream._on_labels(events)
    assert calls == [["r0", "bad", "r2"], ["r0"], ["bad"], ["r2"]]
    assert [(h["opml_error_type"], h["opml_source_offset"]) for _, h in publisher.sent] == [(b"ValueError", b"1")]
    assert acked == [0, 1, 2]
