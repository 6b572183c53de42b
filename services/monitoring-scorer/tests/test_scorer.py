"""The scorer's domain on the real Redis (no broker): windows, rules and alert events, the label join."""

from __future__ import annotations

import io
import json
import time
import uuid
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
from opml.inference.v1 import events_pb2 as inference_events
from opml.monitoring.v1 import label_events_pb2, quality_events_pb2
from opml.monitoring.v1.monitoring_pb2 import GetModelStatusRequest, ListAlertsRequest, ListWindowsRequest
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2 as pb

from opml_common.bus import UntrustedSource
from opml_common.errors import InvalidArgument
from opml_common.events import RecordingEmitter
from opml_common.kserve_codec import encode_outputs, encode_request
from opml_common.metrics import ServiceMetrics
from opml_monitoring_scorer.core import scorer as scorer_module
from opml_monitoring_scorer.core.records import AlertRecord
from opml_monitoring_scorer.core.reference import Task, performance
from opml_monitoring_scorer.core.scorer import Joinable, Scorer, dump_reference, load_reference
from opml_monitoring_scorer.metrics import ScorerMetrics
from opml_monitoring_scorer.servicer import MonitoringServicer
from opml_monitoring_scorer.state import LabelOrigin, MonitorStore, ParkedLabel
from opml_monitoring_scorer.synthetic import FEATURES, SyntheticWorld
from opml_monitoring_scorer_contract.names import LABEL_SOURCE

CONFIG = b"""
features: {x: [x0, x1, x2, x3]}
window: {count: 100}
rules: [{name: low, signal: mpp, under: 0.6, for: 2}]
"""
QA = "plant-3/qa"
QA_CONFIG = CONFIG + f"labels: {{producers: [{QA}]}}\n".encode()
"""The config of bundle ``qa``: its model also accepts the labels of ``plant-3/qa``."""


def origin(event_id: str, *, producer: str = LABEL_SOURCE, seconds: float = 0.0) -> LabelOrigin:
    """A label event's origin: ``producer`` (default: the platform's label tools), at ``seconds`` past a
    fixed time."""
    return LabelOrigin(producer, datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=seconds), event_id)


def events_of(rows, start: int) -> list[tuple[str, bytes]]:
    out = []
    x = np.column_stack([rows.features[f] for f in FEATURES]).astype(np.float32)
    scores = rows.outputs.class_scores().astype(np.float32)
    for i in range(len(x)):
        rid = f"r{start + i}"
        request = encode_request("m", {"x": x[i:i + 1], "color": np.array([[rows.features["color"][i].encode()]],
                                                                          dtype=object)}, request_id=rid)
        response = encode_outputs(pb.ModelInferResponse(id=rid), {"probabilities": scores[i:i + 1]})
        event = inference_events.PredictionMade(request_id=rid, model_name="m", model_version="1",
                                                infer_request=request.SerializeToString(),
                                                infer_response=response.SerializeToString())
        out.append((rid, event.SerializeToString()))
    return out


class Outage:
    """Redis going away: every command sent after the next ``commands`` fails (the client's own
    retries too) until :meth:`end`. ``sent``: the round trips made (a pipeline's or a script call's
    commands go in one)."""

    def __init__(self) -> None:
        self.left: int | None = None
        self.sent = 0

    def after(self, commands: int) -> None:
        self.left = commands

    def end(self) -> None:
        self.left = None

    def client(self) -> aioredis.Redis:
        outage = self

        class Connection(aioredis.Connection):
            async def send_packed_command(self, command, check_health: bool = True) -> None:
                outage.sent += 1
                if outage.left is not None:
                    if outage.left == 0:
                        raise redis.exceptions.ConnectionError("Redis went away (the test's outage)")
                    outage.left -= 1
                await super().send_packed_command(command, check_health)

        return aioredis.Redis(connection_pool=aioredis.ConnectionPool(connection_class=Connection,
                                                                      host="127.0.0.1", port=6379))


@pytest.fixture
def outage() -> Outage:
    return Outage()


@pytest.fixture
async def scorer(outage: Outage):
    world = SyntheticWorld(Task.BINARY, seed=21)
    files = {"reference.npz": dump_reference(world.reference(2000)), "monitoring.yaml": CONFIG}

    async def load(context: str, ref: str):
        return "uuid-1", {**files, "monitoring.yaml": QA_CONFIG} if ref == "qa" else files

    client = outage.client()
    prefix = f"opml-test:{uuid.uuid4().hex[:8]}:"
    emitter = RecordingEmitter()
    scorer = Scorer(store=MonitorStore(client, prefix=prefix, retention_s=600), emitter=emitter,
                    metrics=ScorerMetrics(ServiceMetrics("monitoring-scorer", CollectorRegistry())), load_bundle=load)
    await scorer.register("m", "1", "ctx", "ref")
    yield scorer, world, emitter
    keys = await client.keys(prefix + "*")
    if keys:
        await client.delete(*keys)
    await client.aclose()


def without_reference(client: aioredis.Redis, prefix: str, registry: CollectorRegistry) -> Scorer:
    """A scorer whose bundles hold no reference.npz (the first window is the baseline)."""
    async def load(context: str, ref: str):
        return "uuid-2", {"monitoring.yaml": CONFIG}

    return Scorer(store=MonitorStore(client, prefix=prefix, retention_s=600), emitter=RecordingEmitter(),
                  metrics=ScorerMetrics(ServiceMetrics("monitoring-scorer", registry)), load_bundle=load)


async def test_a_parked_label_of_a_version_without_a_monitor_yet_is_counted_not_raised() -> None:
    """A version without a reference has no monitor until its first window closes: a label parked
    before its prediction cannot join then. It is counted and logged; raised, it stopped the agent
    that keeps predictions for the join (and the label, taken out of Redis, was gone anyway)."""
    world = SyntheticWorld(Task.BINARY, seed=22)
    client = aioredis.Redis(host="127.0.0.1", port=6379)
    prefix = f"opml-test:{uuid.uuid4().hex[:8]}:"
    registry = CollectorRegistry()
    scorer = without_reference(client, prefix, registry)
    try:
        await scorer.register("m", "1", "ctx", "ref")
        assert scorer.models["m/1"].monitor is None
        rows = world.rows(1)
        (rid, raw), = events_of(rows, 0)
        label = label_events_pb2.LabelObserved(request_id=rid, values=[rows.labels[0]]).SerializeToString()
        assert await scorer.on_label(label, origin("e0")) == "parked"
        await scorer.on_prediction_joinable("m/1", 0, raw, rid)
        assert registry.get_sample_value("opml_monitoring_scorer_labels_total", {"outcome": "unjoinable"}) == 1
    finally:
        keys = await client.keys(prefix + "*")
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def test_the_first_window_stays_the_baseline_after_a_restart() -> None:
    """Without a reference the first window is the baseline: it was kept in memory only, so a scorer
    restarted (or another process adopting the version) took the first window it closed, maybe one
    already drifted, and the drift was gone. Its rows are kept in Redis and the baseline rebuilt."""
    world = SyntheticWorld(Task.BINARY, seed=23)
    client = aioredis.Redis(host="127.0.0.1", port=6379)
    prefix = f"opml-test:{uuid.uuid4().hex[:8]}:"
    try:
        first = without_reference(client, prefix, CollectorRegistry())
        await first.register("m", "1", "ctx", "ref")
        clean = [raw for _, raw in events_of(world.rows(300), 0)]
        assert not any(d.drifted for d in (await first.close_window("m/1", 0, clean, 0.0, 1.0)).drift.values())
        shift = np.array([2.0, 0, 0, 0])
        for scorer in (without_reference(client, prefix, CollectorRegistry()),) * 2:  # restarted, then replayed
            await scorer.start()
            drifted = [raw for _, raw in events_of(world.rows(300, shift=shift), 300)]
            score = await scorer.close_window("m/1", 1, drifted, 1.0, 2.0)
            assert score.drift["x0"].drifted and score.drift["x0"].distance > 1.5  # x0 moved by 2 std
        adopted = without_reference(client, prefix, CollectorRegistry())  # another process: no restore
        assert (await adopted.adopt("m/1")).monitor.reference.features["x0"].tolist() == \
            first.models["m/1"].monitor.reference.features["x0"].tolist()
    finally:
        keys = await client.keys(prefix + "*")
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def test_late_labels_join_by_request_id_either_order_once_each(scorer) -> None:
    scorer, world, emitter = scorer
    rows = world.rows(100)
    events = events_of(rows, 0)
    early = label_events_pb2.LabelObserved(request_id="r0", values=[rows.labels[0]]).SerializeToString()
    assert await scorer.on_label(early, origin("e0")) == "parked"
    for rid, raw in events:
        await scorer.on_prediction_joinable("m/1", 0, raw, rid)
    score = await scorer.close_window("m/1", 0, [raw for _, raw in events], time.time(), time.time())
    assert score.rows == 100 and score.labelled == 1
    for i in range(1, 100):
        label = label_events_pb2.LabelObserved(request_id=f"r{i}", values=[rows.labels[i]])
        assert await scorer.on_label(label.SerializeToString(), origin(f"e{i}")) == "joined"
    again = label_events_pb2.LabelObserved(request_id="r5", values=[rows.labels[5]]).SerializeToString()
    assert await scorer.on_label(again, origin("e5")) == "duplicate", "the same event again"
    (record,) = await scorer.store.windows("m/1", before=None, limit=10)
    assert record["labelled"] == 100
    assert record["true"] == pytest.approx(performance(Task.BINARY, rows.outputs.predicted, rows.labels))
    # the window's quality is announced at its close, then again as each label joins it
    scored = [m for m in emitter.messages if isinstance(m, quality_events_pb2.WindowScored)]
    assert [m.labelled for m in scored] == list(range(1, 101))
    first, last = scored[0], scored[-1]
    assert (first.model, first.version, first.window, first.rows, first.task) == ("m", "1", 0, 100, "binary")
    assert first.estimator in ("cbpe", "mpp") and first.HasField("estimate") and first.estimate == record[first.estimator]
    assert last.true_value == pytest.approx(record["true"]) and last.last_time.ToNanoseconds() > 0
    with pytest.raises(InvalidArgument, match="holds 2 values"):
        await scorer.on_label(label_events_pb2.LabelObserved(request_id="r7", values=[1, 0]).SerializeToString(),
                              origin("e7"))
    with pytest.raises(InvalidArgument) as caught:
        await scorer.on_label(label_events_pb2.LabelObserved().SerializeToString(), origin("e"))
    assert [f for f, _ in caught.value.violations] == ["request_id", "values"]


async def test_a_label_joins_in_a_process_that_has_not_seen_its_version_yet(scorer) -> None:
    """Labels are keyed by request id, predictions by version: the process owning a label's partition
    may never have had the version's predictions. It dead-lettered a valid label as malformed; it
    adopts the version (registered in Redis) and joins."""
    scorer, world, _ = scorer
    rows = world.rows(1)
    ((rid, raw),) = events_of(rows, 0)
    await scorer.on_prediction_joinable("m/1", 0, raw, rid)
    other = Scorer(store=scorer.store, emitter=RecordingEmitter(), load_bundle=scorer.load_bundle,
                   metrics=ScorerMetrics(ServiceMetrics("monitoring-scorer", CollectorRegistry())))
    label = label_events_pb2.LabelObserved(request_id=rid, values=[rows.labels[0]]).SerializeToString()
    assert await other.on_label(label, origin("e0")) == "joined"
    assert await scorer.store.truth("m/1", 0) == (1, float(rows.outputs.predicted[0] == rows.labels[0]))


async def test_a_label_whose_join_redis_interrupts_is_counted_once_when_it_comes_again(scorer, outage) -> None:
    """Redis going away at each step of a join in turn, then the label delivered again (at least
    once): the window's truth counts its row once. The join used to claim the label (SET NX) and add
    its truth in a second step: interrupted between the two, the label came again as a duplicate and
    was never counted."""
    scorer, world, _ = scorer
    rows = world.rows(40)
    for window, (request_id, raw) in enumerate(events_of(rows, 0)):
        await scorer.on_prediction_joinable("m/1", window, raw, request_id)
        label = label_events_pb2.LabelObserved(request_id=request_id, values=[rows.labels[window]])
        outage.after(window)  # the window-th command of the join is the first that fails
        try:
            outcome = await scorer.on_label(label.SerializeToString(), origin(request_id))
        except redis.exceptions.ConnectionError:
            outcome = None
        outage.end()
        again = await scorer.on_label(label.SerializeToString(), origin(request_id))
        assert (outcome, again) in ((None, "joined"), (None, "duplicate"), ("joined", "duplicate"))
        correct = float(rows.outputs.predicted[window] == rows.labels[window])
        assert await scorer.store.truth("m/1", window) == (1, correct), f"interrupted at command {window}"
        if outcome == "joined":  # the join got through: every step of it was interrupted once
            break
    else:
        raise AssertionError("no join got through before the outage in 40 tries")


async def test_a_batch_of_join_records_in_one_call_takes_the_labels_that_came_first(scorer) -> None:
    scorer, world, _ = scorer
    rows = world.rows(10)
    events = events_of(rows, 0)
    for i in (3, 7):  # labels before their predictions: parked
        label = label_events_pb2.LabelObserved(request_id=f"r{i}", values=[rows.labels[i]]).SerializeToString()
        assert await scorer.on_label(label, origin(f"e{i}")) == "parked"
    store = scorer.store
    labels = await store.remember_predictions([(rid, "m/1", 4, raw, "", -1) for rid, raw in events])
    assert [i for i, parked in enumerate(labels) if parked] == [3, 7]
    (parked,) = labels[7]
    assert label_events_pb2.LabelObserved.FromString(parked.data).request_id == "r7" and parked.origin == origin("e7")
    assert await store.remember_predictions([(rid, "m/1", 4, raw, "line-2", 1) for rid, raw in events]) == labels, \
        "a parked label stays parked until its join applies it"
    assert await store.find_prediction("r9") == ("m/1", 4, events[9][1], "line-2", 1), "with its segment's window"
    assert 0 < await store.redis.ttl(store._k("pred", "r9")) <= store.retention_s


def observed(request_id: str, value: float) -> bytes:
    return label_events_pb2.LabelObserved(request_id=request_id, values=[value]).SerializeToString()


def counted(scorer: Scorer, outcome: str) -> float:
    """The scorer's opml_monitoring_scorer_labels_total{outcome}."""
    (metric,) = scorer.metrics.labels.collect()
    return next((s.value for s in metric.samples if s.name.endswith("_total") and s.labels == {"outcome": outcome}),
                0.0)


async def test_labels_are_applied_only_from_the_producers_the_model_accepts(scorer) -> None:
    """Labels from anyone were joined (and a true label after them was dropped as a duplicate). A label
    is applied only from the platform's producers or one its model's monitoring.yaml names; before its
    prediction it is parked only from a producer some model names, each producer's apart, and checked
    against the prediction's model when it comes."""
    scorer, world, _ = scorer
    await scorer.register("n", "1", "ctx", "qa")  # n/1 accepts plant-3/qa; m/1 only the platform's
    rows = world.rows(3)
    (r0, raw0), (r1, raw1), (r2, raw2) = events_of(rows, 0)
    right = [float(v) for v in rows.outputs.predicted]
    with pytest.raises(UntrustedSource, match="'evil/anyone' is not a label producer of any monitored model"):
        await scorer.on_label(observed(r0, 1 - right[0]), origin("x0", producer="evil/anyone"))
    assert await scorer.store.redis.exists(scorer.store._k("labels", r0)) == 0, "nothing parked"
    assert await scorer.on_label(observed(r0, 1 - right[0]), origin("q0", producer=QA)) == "parked"
    assert await scorer.on_label(observed(r0, right[0]), origin("p0")) == "parked"
    await scorer.on_prediction_joinable("m/1", 0, raw0, r0)
    assert counted(scorer, "untrusted") == 1, "n/1's producer's label of an m/1 request is dropped when it comes"
    assert await scorer.store.truth("m/1", 0) == (1, 1.0), "the platform's label joined, parked after it"

    await scorer.on_prediction_joinable("m/1", 1, raw1, r1)
    for producer in ("evil/anyone", QA):
        with pytest.raises(UntrustedSource, match=f"'{producer}' is not a label producer of m/1"):
            await scorer.on_label(observed(r1, 1 - right[1]), origin(f"x-{producer}", producer=producer))
    assert await scorer.store.truth("m/1", 1) == (0, 0.0)
    assert await scorer.on_label(observed(r1, right[1]), origin("p1")) == "joined"
    await scorer.on_prediction_joinable("n/1", 0, raw2, r2)
    assert await scorer.on_label(observed(r2, right[2]), origin("q2", producer=QA)) == "joined"
    assert await scorer.store.truth("n/1", 0) == (1, 1.0)


async def test_a_label_is_replaced_only_by_its_producer_with_a_newer_time(scorer) -> None:
    """The first label of a request stays; its producer's later one (a newer event time) corrects it,
    an older one or the same event again does not, nor does another producer's (counted as
    other_producer). So is a parked one, per producer."""
    scorer, world, _ = scorer
    await scorer.register("n", "1", "ctx", "qa")
    rows = world.rows(2)
    (r0, raw0), (r1, raw1) = events_of(rows, 0)
    right = [float(v) for v in rows.outputs.predicted]
    await scorer.on_prediction_joinable("n/1", 0, raw0, r0)
    steps = [(1 - right[0], origin("a"), "joined", 0.0), (right[0], origin("b", seconds=10), "corrected", 1.0),
             (1 - right[0], origin("c", seconds=5), "duplicate", 1.0), (right[0], origin("b", seconds=10),
                                                                      "duplicate", 1.0),
             (1 - right[0], origin("d", producer=QA, seconds=20), "other_producer", 1.0),
             (1 - right[0], origin("e", seconds=30), "corrected", 0.0)]
    for value, by, outcome, correct in steps:
        assert await scorer.on_label(observed(r0, value), by) == outcome, by
        assert await scorer.store.truth("n/1", 0) == (1, correct), by

    assert await scorer.on_label(observed(r1, 1 - right[1]), origin("f", producer=QA)) == "parked"
    assert await scorer.on_label(observed(r1, right[1]), origin("g", producer=QA, seconds=-5)) == "duplicate"
    assert await scorer.on_label(observed(r1, right[1]), origin("h", producer=QA, seconds=5)) == "parked"
    assert await scorer.on_label(observed(r1, 1 - right[1]), origin("i", seconds=9)) == "parked"
    await scorer.on_prediction_joinable("n/1", 1, raw1, r1)
    assert await scorer.store.truth("n/1", 1) == (1, 1.0), "plant-3/qa's correction, parked first, is applied"
    assert counted(scorer, "other_producer") == 2

    await scorer.store.redis.set(scorer.store._k("joined", "r9"), "1")  # applied before producers were kept
    await scorer.on_prediction_joinable("n/1", 1, events_of(world.rows(1), 9)[0][1], "r9")
    assert await scorer.on_label(observed("r9", 1.0), origin("j")) == "other_producer"


async def test_labels_before_their_predictions_are_parked_in_one_round_trip(scorer, outage) -> None:
    """Each label that came before its prediction was parked with a Redis call of its own (a batch of
    500 labels of requests not served yet made 500 round trips). A batch's are parked in one script call,
    with the outcomes the labels one by one would have: in order, each producer's apart, a producer's
    label not newer than its parked one a duplicate, a newer one replacing it, a label whose prediction
    is there joined, one from a producer no model accepts refused; kept with the expiry, and joined in
    the order they came when their predictions come."""
    scorer, world, _ = scorer
    await scorer.register("n", "1", "ctx", "qa")  # n/1 accepts plant-3/qa: its labels may be parked
    rows = world.rows(40)
    events = events_of(rows, 0)
    right = [float(v) for v in rows.outputs.predicted]
    await scorer.store.park_labels([("warm", ParkedLabel(origin("w"), b""))])  # the script loaded
    await scorer.on_prediction_joinable("m/1", 0, events[39][1], "r39")
    batch = [(observed(f"r{i}", right[i]), origin(f"e{i}")) for i in range(39)]
    batch += [(observed("r0", 1 - right[0]), origin("e0-old", seconds=-5)),  # its producer's, older
              (observed("r1", 1 - right[1]), origin("e1-fix", seconds=5)),  # its producer's, newer
              (observed("r2", 1 - right[2]), origin("q2", producer=QA)),  # another producer's
              (observed("r39", right[39]), origin("e39")),  # its prediction is there
              (observed("r99", 1.0), origin("x99", producer="evil/anyone"))]
    sent = outage.sent
    outcomes = await scorer.on_labels(batch)
    round_trips = outage.sent - sent
    assert outcomes[:-1] == ["parked"] * 39 + ["duplicate", "parked", "parked", "joined"]
    assert isinstance(outcomes[-1], UntrustedSource)
    # the look-up, the two producers' checks, the parking, the join and its window's read: not one per label
    assert round_trips <= 6, round_trips
    store = scorer.store
    assert 0 < await store.redis.ttl(store._k("labels", "r38")) <= store.retention_s
    assert await store.redis.exists(store._k("labels", "r99")) == 0, "nothing parked for nobody's producer"

    await scorer.on_predictions_joinable([Joinable("m/1", 0, raw, rid) for rid, raw in events[:39]])
    assert await store.truth("m/1", 0) == (40, 39.0), "r1 by its producer's newer label, r2 by the first"
    assert [counted(scorer, outcome) for outcome in ("parked", "duplicate", "joined", "untrusted")] == [41, 1, 40, 1]
    assert await store.redis.exists(*(store._k("labels", f"r{i}") for i in range(39))) == 0, "taken once"


async def test_a_batch_of_labels_applied_again_after_a_failure_counts_each_label_joined_once(scorer, outage) -> None:
    """Redis going away at each step of a batch's join in turn, then the batch applied again (as the
    stream does): each label is counted joined once, taught to the MPP once and in its window's truth
    once. The outcomes were counted only once the windows were saved: a failure after the join script
    (a window's save) left the labels joined but never counted, and the batch again counted them as
    duplicates only."""
    scorer, world, _ = scorer
    mpp = scorer.get("m/1").monitor.mpp
    rows = world.rows(8 * 30)
    events = events_of(rows, 0)
    for attempt in range(30):
        window = events[attempt * 8:(attempt + 1) * 8]
        for request_id, raw in window:
            await scorer.on_prediction_joinable("m/1", attempt, raw, request_id)
        await scorer.close_window("m/1", attempt, [raw for _, raw in window], 0.0, 1.0)
        batch = [(observed(request_id, rows.labels[attempt * 8 + i]), origin(request_id))
                 for i, (request_id, _) in enumerate(window)]
        outage.after(attempt)  # the attempt-th command of the batch's join is the first that fails
        try:
            first = await scorer.on_labels(batch)
        except redis.exceptions.ConnectionError:
            first = None
        outage.end()
        again = await scorer.on_labels(batch)
        joined = 8 * (attempt + 1)
        assert counted(scorer, "joined") == joined, f"interrupted at command {attempt}: {first}, {again}"
        assert mpp.labels == joined and (await scorer.store.truth("m/1", attempt))[0] == 8
        assert (await scorer.store.get_window("m/1", attempt))["labelled"] == 8
        if first == ["joined"] * 8:  # the join got through: every step of it was interrupted once
            break
    else:
        raise AssertionError("no join got through before the outage in 30 tries")


async def test_parked_labels_outlive_a_failure_between_their_prediction_and_their_join(scorer, outage) -> None:
    """The call that kept a prediction took its parked labels out of Redis: Redis going away after it,
    before the join, lost them, and the prediction replayed (as the stream does) found nothing parked.
    Redis going away at each step in turn, then the predictions replayed: each parked label is applied
    once (joined, taught to the MPP and in its window's truth once; another producer's counted
    other_producer once, one the model does not accept untrusted once) and none is left parked."""
    scorer, world, _ = scorer
    await scorer.register("n", "1", "ctx", "qa")  # n/1 accepts plant-3/qa; m/1 only the platform's
    mpp = scorer.get("n/1").monitor.mpp
    store = scorer.store
    for attempt in range(20):
        rows = world.rows(4)
        events = events_of(rows, attempt * 4)
        right = [float(v) for v in rows.outputs.predicted]
        (r0, _), (r1, _), (r2, _), (r3, _) = events
        assert await scorer.on_labels([(observed(r0, right[0]), origin(f"p{r0}")),
                                       (observed(r1, right[1]), origin(f"p{r1}")),
                                       (observed(r1, 1 - right[1]), origin(f"q{r1}", producer=QA, seconds=1)),
                                       (observed(r2, right[2]), origin(f"q{r2}", producer=QA)),
                                       (observed(r3, right[3]), origin(f"q{r3}", producer=QA))]) == ["parked"] * 5
        joinable = [Joinable("n/1", attempt, raw, rid) for rid, raw in events[:3]]
        joinable.append(Joinable("m/1", attempt, events[3][1], r3))  # its QA label is untrusted for m/1
        outage.after(attempt)  # the attempt-th command after the predictions came is the first that fails
        try:
            await scorer.on_predictions_joinable(joinable)
            failed = False
        except redis.exceptions.ConnectionError:
            failed = True
        outage.end()
        await scorer.on_predictions_joinable(joinable)  # replayed
        at = f"interrupted at command {attempt}"
        assert await store.truth("n/1", attempt) == (3, 3.0), at
        assert await store.truth("m/1", attempt) == (0, 0.0), at
        assert mpp.labels == 3 * (attempt + 1), at
        assert [counted(scorer, outcome) for outcome in ("joined", "other_producer", "untrusted", "duplicate")] == \
            [3 * (attempt + 1), attempt + 1, attempt + 1, 0], at
        assert await store.redis.exists(*(store._k("labels", rid) for rid, _ in events)) == 0, at
        if not failed:  # every step was interrupted once
            break
    else:
        raise AssertionError("no prediction join got through before the outage in 20 tries")


async def test_parked_labels_are_joined_by_the_prediction_replayed_after_the_process_died(scorer) -> None:
    """A scorer that died after keeping a prediction and before joining its parked labels: the one
    that replays the prediction joins them."""
    scorer, world, _ = scorer
    rows = world.rows(2)
    events = events_of(rows, 0)
    right = [float(v) for v in rows.outputs.predicted]
    for i, (rid, _) in enumerate(events):
        assert await scorer.on_label(observed(rid, right[i]), origin(f"e{i}")) == "parked"
    await scorer.store.remember_predictions([(rid, "m/1", 0, raw, "", -1) for rid, raw in events])  # then died
    restarted = Scorer(store=scorer.store, emitter=RecordingEmitter(), load_bundle=scorer.load_bundle,
                       metrics=ScorerMetrics(ServiceMetrics("monitoring-scorer", CollectorRegistry())))
    await restarted.start()
    await restarted.on_predictions_joinable([Joinable("m/1", 0, raw, rid) for rid, raw in events])
    assert await scorer.store.truth("m/1", 0) == (2, 2.0)
    assert counted(restarted, "joined") == 2 and restarted.get("m/1").monitor.mpp.labels == 2


async def test_the_same_labels_sent_again_as_new_events_are_duplicates_not_corrections(scorer) -> None:
    """Labels submitted without a time (SubmitLabels, `opml monitor label` without a time column) get
    a new event id and a newer time each time they are sent: sent again (a retried call or file), each
    was counted again as a correction that changed nothing. The same values from the same producer are
    a duplicate, which moves the request's label on to the newer time; other values still correct it."""
    scorer, world, _ = scorer
    rows = world.rows(1)
    ((request_id, raw),) = events_of(rows, 0)
    right = float(rows.outputs.predicted[0])
    await scorer.on_prediction_joinable("m/1", 0, raw, request_id)
    assert await scorer.on_label(observed(request_id, right), origin("a")) == "joined"
    assert await scorer.on_label(observed(request_id, right), origin("a-again", seconds=10)) == "duplicate"
    assert await scorer.on_label(observed(request_id, 1 - right), origin("b", seconds=5)) == "duplicate", \
        "older than the label sent again"
    assert await scorer.store.truth("m/1", 0) == (1, 1.0)
    assert [counted(scorer, outcome) for outcome in ("joined", "corrected", "duplicate")] == [1, 0, 2]
    assert await scorer.on_label(observed(request_id, 1 - right), origin("c", seconds=20)) == "corrected"
    assert await scorer.store.truth("m/1", 0) == (1, 0.0)
    assert scorer.get("m/1").monitor.mpp.labels == 1


async def test_a_replayed_window_close_steps_the_rules_once(scorer) -> None:
    scorer, world, emitter = scorer
    await scorer.set_rules("m/1", "rules: [{name: always, signal: score, under: 1.01, for: 2}]")
    for index in range(3):
        raws = [raw for _, raw in events_of(world.rows(100), index * 100)]
        await scorer.close_window("m/1", index, raws, 0.0, 1.0)
        await scorer.close_window("m/1", index, raws, 0.0, 1.0)  # the same close again, as after a crash
    raised = [m for m in emitter.messages if type(m).__name__ == "AlertRaised"]
    assert [(m.rule, m.evidence.window) for m in raised] == [("always", 1)]
    assert (await scorer.store.rule_states("m/1"))["always"]["breach_run"] == 3
    assert await scorer.store.window_count("m/1") == 3


def npz(rows: int) -> bytes:
    """A valid reference of ``rows`` rows of zeros, compressed (about a thousandth of its size)."""
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **{"feature.x": np.zeros(rows), "predicted": np.zeros(rows)})
    return buffer.getvalue()


def test_a_reference_is_refused_by_what_it_expands_to_before_it_is_loaded(monkeypatch) -> None:
    """The size cap applied to the stored bytes only: a compressed npz of zeros passed it and expanded
    about a thousand times in memory."""
    monkeypatch.setattr(scorer_module, "MAX_REFERENCE_BYTES", 1024 * 1024)
    bomb = npz(200_000)  # 3.2 MB of arrays in a few KB
    assert len(bomb) < 64 * 1024
    with pytest.raises(InvalidArgument, match=r"^reference.npz: expands to \d+ bytes, more than 1048576$"):
        load_reference(bomb, task=Task.REGRESSION)
    assert len(load_reference(npz(10_000), task=Task.REGRESSION)) == 10_000


def test_a_reference_of_too_many_rows_is_refused_from_its_array_headers(monkeypatch) -> None:
    monkeypatch.setattr(scorer_module, "MAX_REFERENCE_ROWS", 1000)
    with pytest.raises(InvalidArgument) as caught:
        load_reference(npz(1001), task=Task.REGRESSION)
    assert list(caught.value.violations) == [("reference.npz.feature.x", "holds 1001 rows, more than 1000"),
                                       ("reference.npz.predicted", "holds 1001 rows, more than 1000")]
    with pytest.raises(InvalidArgument, match=r"^reference.npz: is not a numpy .npz of arrays"):
        load_reference(b"PK\x03\x04 not a zip", task=Task.REGRESSION)


async def test_the_status_counts_each_window_s_rows_once_without_reading_the_windows(scorer) -> None:
    """The status summed the rows of every window record it read (all of them, on each call): windows
    never expire, so GetModelStatus, RegisterModel and ListModels grew with the history. The total is
    kept as windows are saved; a window saved again (a replayed close, a label joined) adds nothing."""
    scorer, world, _ = scorer
    for index, rows in enumerate((100, 60)):
        raws = [raw for _, raw in events_of(world.rows(rows), index * 100)]
        await scorer.close_window("m/1", index, raws, 0.0, 1.0)
        await scorer.close_window("m/1", index, raws, 0.0, 1.0)  # replayed after a crash
    store, read = scorer.store, []
    windows = store.windows

    async def counted(mv, *, before, limit):
        read.append(limit)
        return await windows(mv, before=before, limit=limit)

    store.windows = counted
    status = await MonitoringServicer(scorer).GetModelStatus(GetModelStatusRequest(name="models/m/versions/1"), None)
    assert (status.predictions, status.windows, read) == (160, 2, [1])


async def test_the_rows_of_windows_saved_before_the_total_was_kept_are_summed_once(scorer) -> None:
    scorer, _, _ = scorer
    store = scorer.store
    for index, rows in ((0, 30), (1, 40)):  # as windows were saved before
        await store.redis.hset(store._k("windows", "m/1"), str(index), json.dumps({"index": index, "rows": rows}))
        await store.redis.zadd(store._k("windex", "m/1"), {str(index): index})
    await store.save_window("m/1", {"index": 2, "rows": 5})
    assert await store.total_rows("m/1") == 75
    await store.save_window("m/1", {"index": 2, "rows": 5})
    assert await store.total_rows("m/1") == 75 and await store.total_rows("m/2") == 0


async def test_list_alerts_pages_through_every_alert_of_every_version_in_order(scorer) -> None:
    """ListAlerts read at most 10,000 alerts per version and paged over those: older ones were never
    listed. Pages continue from the last alert's place (alerts of one window ordered by rule)."""
    scorer, _, _ = scorer
    await scorer.register("m", "2", "ctx", "ref")
    saved = [AlertRecord("m", "1", rule, "drift", window, 0.5) for window in range(5001) for rule in ("b", "a")]
    saved += [AlertRecord("m", "2", rule, "mpp", window, 0.1) for window in (0, 4999, 5000) for rule in ("c", "a")]
    for alert in saved:
        await scorer.store.save_alert(alert)
    servicer = MonitoringServicer(scorer)

    async def listed(name: str, size: int) -> list[tuple]:
        got, token = [], ""
        while True:
            page = await servicer.ListAlerts(ListAlertsRequest(name=name, page_size=size, page_token=token), None)
            assert len(page.alerts) <= size
            got += [(-a.raised_at_window, a.name, a.rule) for a in page.alerts]
            if not (token := page.next_page_token):
                return got
    expected = sorted((-a.raised_at_window, f"models/{a.model}/versions/{a.version}", a.rule) for a in saved)
    assert await listed("", 1000) == expected
    assert await listed("models/m/versions/2", 3) == [a for a in expected if a[1] == "models/m/versions/2"]
    with pytest.raises(InvalidArgument, match="other filters"):  # a token for another name
        first = await servicer.ListAlerts(ListAlertsRequest(page_size=1), None)
        await servicer.ListAlerts(ListAlertsRequest(name="models/m/versions/1", page_token=first.next_page_token), None)


async def test_a_batch_of_labels_ends_as_its_labels_one_by_one_and_announces_each_window_once(scorer) -> None:
    """The labels agent applies labels a batch at a time (one look-up, one join script, each window
    saved once): its outcomes and truths are the ones the labels would make one by one, in order (a
    correction after its label in the same batch, the same event again, another producer's, one before
    its prediction, malformed ones), and each closed window it touched is saved and announced once with
    its truth after the batch, not once per label."""
    scorer, world, emitter = scorer
    await scorer.register("n", "1", "ctx", "qa")
    rows = world.rows(200)
    events = events_of(rows, 0)
    right = [float(v) for v in rows.outputs.predicted]
    for i, (request_id, raw) in enumerate(events):
        await scorer.on_prediction_joinable("m/1", i // 100, raw, request_id)
    await scorer.close_window("m/1", 0, [raw for _, raw in events[:100]], 0.0, 1.0)
    await scorer.close_window("m/1", 1, [raw for _, raw in events[100:]], 1.0, 2.0)
    r500, raw500 = events_of(world.rows(1), 500)[0]
    await scorer.on_prediction_joinable("n/1", 0, raw500, r500)  # n/1 accepts QA's labels too
    before = len(emitter.messages)
    batch = [(observed(f"r{i}", right[i]), origin(f"e{i}")) for i in range(150)]
    batch += [(observed("r0", 1 - right[0]), origin("e0-fix", seconds=10)),  # its producer's newer label
              (observed("r1", right[1]), origin("e1")),  # the same event again
              (observed(r500, 1.0), origin("q500", producer=QA)),
              (observed(r500, 0.0), origin("p500", seconds=30)),  # another producer's, after QA's
              (observed("r2", right[2]), origin("q2", producer=QA)),  # a producer n/1 accepts, not m/1
              (label_events_pb2.LabelObserved(request_id="r4", values=[1, 0]).SerializeToString(), origin("x4")),
              (label_events_pb2.LabelObserved().SerializeToString(), origin("x5")),
              (observed("r999", 1.0), origin("e999"))]  # before its prediction
    outcomes = await scorer.on_labels(batch)
    assert outcomes[:150] == ["joined"] * 150
    assert outcomes[150:154] == ["corrected", "duplicate", "joined", "other_producer"]
    assert isinstance(outcomes[154], UntrustedSource) and "'plant-3/qa' is not a label producer of m/1" in str(
        outcomes[154])
    assert isinstance(outcomes[155], InvalidArgument) and "holds 2 values" in str(outcomes[155])
    assert isinstance(outcomes[156], InvalidArgument)
    assert outcomes[157] == "parked"
    assert await scorer.store.truth("m/1", 0) == (100, 99.0)
    assert await scorer.store.truth("m/1", 1) == (50, 50.0)
    saved = [await scorer.store.get_window("m/1", index) for index in (0, 1)]
    assert [(w["labelled"], w["true"]) for w in saved] == [(100, 0.99), (50, 1.0)]
    scored = [m for m in emitter.messages[before:] if isinstance(m, quality_events_pb2.WindowScored)]
    assert [(m.window, m.labelled) for m in scored] == [(0, 100), (1, 50)], "each window announced once"
    assert [counted(scorer, outcome) for outcome in ("joined", "corrected", "duplicate", "other_producer", "parked")
            ] == [151, 1, 1, 1, 1]


async def test_a_label_applied_again_after_a_crash_saves_the_window_its_first_try_did_not(scorer) -> None:
    """At least once: a batch is applied again when the process died between the join script and the
    windows' saves. Its labels are duplicates then, and a window saved with another truth than the
    one joined is saved and announced again; one saved with it is not."""
    scorer, world, emitter = scorer
    rows = world.rows(100)
    events = events_of(rows, 0)
    for request_id, raw in events:
        await scorer.on_prediction_joinable("m/1", 0, raw, request_id)
    await scorer.close_window("m/1", 0, [raw for _, raw in events], 0.0, 1.0)
    label = (observed("r0", float(rows.outputs.predicted[0])), origin("e0"))
    assert await scorer.on_labels([label]) == ["joined"]
    record = await scorer.store.get_window("m/1", 0)
    before = len(emitter.messages)
    assert await scorer.on_labels([label]) == ["duplicate"]
    assert len(emitter.messages) == before, "saved with its truth: not announced again"
    record.pop("labelled"), record.pop("true")  # as saved at its close, before the label's join
    await scorer.store.save_window("m/1", record)
    assert await scorer.on_labels([label]) == ["duplicate"]
    assert (await scorer.store.get_window("m/1", 0))["labelled"] == 1
    (scored,) = emitter.messages[before:]
    assert (scored.window, scored.labelled, scored.true_value) == (0, 1, 1.0)


async def test_list_windows_gives_the_open_window_s_labels_so_far_when_asked(scorer) -> None:
    """A rollout's accuracy check saw a version's labels only once 1,000 predictions closed their
    window. ListWindows with include_open gives first the open window (the one after the newest saved)
    with the truth of the labels joined to it so far; without it, or before any label joined it, or on
    a later page, only saved windows; WindowScored is not emitted for it."""
    scorer, world, emitter = scorer
    servicer = MonitoringServicer(scorer)
    rows = world.rows(150)
    events = events_of(rows, 0)
    right = [float(v) for v in rows.outputs.predicted]

    async def listed(**fields) -> list[tuple]:
        reply = await servicer.ListWindows(ListWindowsRequest(name="models/m/versions/1", **fields), None)
        return [(w.index, w.open, w.labelled, w.true_value if w.HasField("true_value") else None)
                for w in reply.windows]

    for i, (request_id, raw) in enumerate(events):
        await scorer.on_prediction_joinable("m/1", i // 100, raw, request_id)
    assert await listed(include_open=True) == [], "nothing saved, nothing labelled"
    await scorer.on_labels([(observed("r0", right[0]), origin("e0"))])
    assert await listed(include_open=True) == [(0, True, 1, 1.0)], "window 0 open, one label in it"
    await scorer.close_window("m/1", 0, [raw for _, raw in events[:100]], 1.0, 2.0)
    assert await listed(include_open=True) == [(0, False, 1, 1.0)], "window 1 open, no label in it"
    before = len(emitter.messages)
    await scorer.on_labels([(observed(f"r{i}", right[i] if i % 2 else 1 - right[i]), origin(f"e{i}"))
                            for i in range(100, 110)])
    assert not [m for m in emitter.messages[before:] if isinstance(m, quality_events_pb2.WindowScored)]
    reply = await servicer.ListWindows(ListWindowsRequest(name="models/m/versions/1", include_open=True), None)
    opened = reply.windows[0]
    assert (opened.index, opened.open, opened.labelled, opened.true_value) == (1, True, 10, 0.5)
    assert opened.first_time.ToNanoseconds() == 2_000_000_000, "after the newest saved window's last prediction"
    assert await listed() == [(0, False, 1, 1.0)]
    assert await listed(include_open=True, page_size=1, page_token="1") == [(0, False, 1, 1.0)], \
        "a later page holds saved windows only"
