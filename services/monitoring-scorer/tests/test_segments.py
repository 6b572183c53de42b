"""Segments (monitoring.yaml ``segment: {parameter: line}``), no broker: the config's checks, the bound on
a version's segments, and the stream splitting records by their request parameter into the version's
window and each segment's, acking a record only once every window it went to is closed, skipping on a
replay only the parts in windows closed before, and joining a label to both windows."""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import redis.asyncio as aioredis
from opml.inference.v1 import events_pb2
from opml.monitoring.v1 import quality_events_pb2
from opml.monitoring.v1.label_events_pb2 import LabelObserved
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2 as pb

from opml_common.config import PlatformSettings
from opml_common.errors import InvalidArgument
from opml_common.events import RecordingEmitter
from opml_common.metrics import ServiceMetrics
from opml_monitoring_scorer.core.config import MonitoringConfig
from opml_monitoring_scorer.core.reference import Task
from opml_monitoring_scorer.core.scorer import Scorer, dump_reference
from opml_monitoring_scorer.core.segments import OTHER, SegmentBook, parameter_value, window_key
from opml_monitoring_scorer.metrics import ScorerMetrics
from opml_monitoring_scorer.state import LabelOrigin, MonitorStore
from opml_monitoring_scorer.stream import ScoringStream
from opml_monitoring_scorer.synthetic import SyntheticWorld

from .test_stream_records import Table, batch_of, prediction, record

CONFIG = b"features: {x: [x0, x1, x2, x3]}\nwindow: {count: 10}\nsegment: {parameter: line}\n"


def on_line(made: events_pb2.PredictionMade, line: str | int | float | None) -> events_pb2.PredictionMade:
    """The prediction with its request's parameter ``line`` (a request-level parameter, as tritonclient
    sends ``parameters={"line": "3"}``); None: without it."""
    request = pb.ModelInferRequest.FromString(made.infer_request)
    if isinstance(line, str):
        request.parameters["line"].string_param = line
    elif isinstance(line, int):
        request.parameters["line"].int64_param = line
    elif isinstance(line, float):
        request.parameters["line"].double_param = line
    made.infer_request = request.SerializeToString()
    return made


def test_the_segment_setting_is_checked_with_the_others() -> None:
    config = MonitoringConfig.parse("segment: {parameter: line}\n")
    assert config.segment_parameter == "line"
    assert MonitoringConfig.parse("window: {count: 10}\n").segment_parameter is None
    with pytest.raises(InvalidArgument) as raised:
        MonitoringConfig.parse("segment: {parameter: 3, by: line}\nwindow: {count: 1}\n")
    assert sorted(field for field, _ in raised.value.violations) == ["segment.by", "segment.parameter", "window.count"]
    for bad in ("segment: line\n", "segment: {parameter: ''}\n", f"segment: {{parameter: {'p' * 65}}}\n"):
        with pytest.raises(InvalidArgument) as raised:
            MonitoringConfig.parse(bad)
        assert [field for field, _ in raised.value.violations] in (["segment"], ["segment.parameter"]), bad


def test_a_request_parameter_names_the_segment_string_or_integer() -> None:
    def request(line: str | int | float | None) -> bytes:
        return on_line(prediction(0), line).infer_request

    assert parameter_value(request("3"), "line") == "3"
    assert parameter_value(request(7), "line") == "7"
    assert parameter_value(request(None), "line") == ""
    assert parameter_value(b"", "line") == "", "a summary-only prediction carries no request"
    assert parameter_value(request(2.5), "line") is None, "neither a string nor an integer"


def test_a_version_admits_a_bounded_number_of_segments_the_rest_go_to_other() -> None:
    book = SegmentBook(["a"], limit=2)
    assert book.admit("a") == ("a", False)
    assert book.admit("b") == ("b", False)
    assert book.admit("c") == (OTHER, True), "past the bound"
    assert book.admit("b") == ("b", False), "admitted before"
    assert book.admit("") == ("", False), "without the parameter: the version's windows only"
    assert book.admit(None) == (OTHER, True)
    assert book.admit("x" * 65) == (OTHER, True)
    assert book.admit(OTHER) == (OTHER, False)
    assert book.known == {"a", "b"}
    assert window_key("m/1", "") == "m/1" and window_key("m/1", "b") == "m/1#b"


@pytest.fixture
def files() -> dict[str, bytes]:
    world = SyntheticWorld(Task.BINARY, seed=5)
    return {"reference.npz": dump_reference(world.reference(500)), "monitoring.yaml": CONFIG}


@pytest.fixture
async def scorer(files: dict[str, bytes]):
    async def load(context: str, ref: str):
        return "uuid-1", files

    client = aioredis.Redis.from_url("redis://127.0.0.1:6379")
    prefix = f"opml-test:{uuid.uuid4().hex[:8]}:"
    metrics = ScorerMetrics(ServiceMetrics("monitoring-scorer", CollectorRegistry()))
    scorer = Scorer(store=MonitorStore(client, prefix=prefix, retention_s=600), emitter=RecordingEmitter(),
                    metrics=metrics, load_bundle=load)
    await scorer.register("m", "1", "ctx", "ref")
    yield scorer
    keys = await client.keys(prefix + "*")
    if keys:
        await client.delete(*keys)
    await client.aclose()


def new_stream(scorer: Scorer, tmp_path: Path, table: Table) -> ScoringStream:
    stream = ScoringStream(PlatformSettings(), scorer, scorer.metrics, publisher=None, datadir=tmp_path)
    stream.app = SimpleNamespace(flow_control=SimpleNamespace(is_active=lambda: True), consumer_generation_id=1)
    stream.windows = table
    return stream


def traffic(acked: list[int]) -> list:
    """Records 0-5 of one version, each a PredictionBatch of 5 one-row predictions: lines 1, 2, 1, 2 and one
    without the parameter; the version's windows (10) close at records 1, 3, 5; line 1's and line 2's
    (2 per record) at records 4 (10 rows each)."""
    events = []
    for offset in range(6):
        made = [on_line(prediction(offset * 5 + i), line)
                for i, line in enumerate(("1", "2", "1", "2", None))]
        event = record(batch_of(*made), offset)
        event.message.generation_id = 1
        event.ack = lambda offset=offset: acked.append(offset)
        events.append(event)
    return events


async def test_records_split_into_the_versions_window_and_each_segments_acked_when_all_closed(
        scorer, tmp_path) -> None:
    acked: list[int] = []
    table = Table()
    stream = new_stream(scorer, tmp_path, table)
    events = traffic(acked)
    await stream._on_batch(events[:4])
    store = scorer.store
    assert [(await store.get_window("m/1", i))["rows"] for i in (0, 1)] == [10, 10]
    assert await store.get_window("m/1#1", 0) is None, "line 1 has 8 rows so far"
    assert acked == [], "records 0-3 are in line 1's and line 2's open windows"
    await stream._on_batch(events[4:])
    for line in ("1", "2"):
        window = await store.get_window(f"m/1#{line}", 0)
        assert (window["rows"], window["segment"]) == (10, line)
        assert window["first_time"] == pytest.approx(1_700_000_000 + (0 if line == "1" else 0.001))
    assert (await store.get_window("m/1", 2))["rows"] == 10
    assert acked == [0, 1, 2, 3, 4], "record 5 is in the segments' open windows"
    assert table.data["m/1"] == {"index": 3, "partition": 0, "through": 5}
    assert table.data["m/1#1"] == table.data["m/1#2"] == {"index": 1, "partition": 0, "through": 4}
    scored = [m for m in scorer.emitter.messages if isinstance(m, quality_events_pb2.WindowScored)]
    assert sorted((e.segment, e.window) for e in scored) == [("", 0), ("", 1), ("", 2), ("1", 0), ("2", 0)]
    assert await store.segments("m/1") == ["1", "2"]

    # a label of record 2's third prediction (line 1): window 1 of the version and window 0 of line 1 take it
    origin = LabelOrigin("opml/monitoring-scorer/labels", dt.datetime.now(dt.UTC), "e1")
    label = LabelObserved(request_id="r12", values=[1.0]).SerializeToString()
    assert await scorer.on_label(label, origin) == "joined"
    assert (await store.get_window("m/1", 1))["labelled"] == 1
    assert (await store.get_window("m/1#1", 0))["labelled"] == 1
    assert (await store.get_window("m/1#2", 0)).get("labelled", 0) == 0

    # a restart fed again from the committed offset (record 5): the version's part is skipped (its
    # window closed through 5), the segments' parts rebuild their open windows; later records close them
    acked_again: list[int] = []
    restarted = new_stream(scorer, tmp_path, table)
    again = traffic(acked_again)
    await restarted._on_batch(again[5:])
    assert set(restarted._open) == {"m/1#1", "m/1#2"}
    assert [w.rows for w in restarted._open.values()] == [2, 2]
    assert acked_again == []


async def test_segments_past_the_bound_go_to_other_and_are_counted(scorer, tmp_path) -> None:
    acked: list[int] = []
    stream = new_stream(scorer, tmp_path, Table())
    stream._segments["m/1"] = SegmentBook(limit=1)
    events = []
    for offset in range(4):
        made = [on_line(prediction(offset * 5 + i), line) for i, line in enumerate(("a", "b", "c", 4, 0.5))]
        event = record(batch_of(*made), offset)
        event.message.generation_id = 1
        event.ack = lambda offset=offset: acked.append(offset)
        events.append(event)
    await stream._on_batch(events)
    store = scorer.store
    assert set(stream._open) == {"m/1", "m/1#a", f"m/1#{OTHER}"}
    assert stream._open["m/1#a"].rows == 4, "one a record, in its open window"
    assert (await store.get_window(f"m/1#{OTHER}", 0))["rows"] == 12, "b, c, 4 and 0.5: 4 a record"
    assert await store.segments("m/1") == [OTHER]
    (metric,) = scorer.metrics.segment_other.collect()
    assert [s.value for s in metric.samples if s.name.endswith("_total")] == [16.0]
    assert acked == [], "every record is in a's open window"


def test_a_segment_record_keeps_its_predictions_rows_in_order() -> None:
    from opml_monitoring_scorer.stream import DecodedRecord

    made = [on_line(prediction(i, rows=2 if i == 1 else 1), line) for i, line in enumerate(("1", "2", "1", None))]
    batch = SimpleNamespace()
    decoded = DecodedRecord.of("m/1", made, None, [(batch, 0, [1, 2, 1, 1])], SimpleNamespace(timestamp=0.0), [])
    decoded.split(["1", "2", "1", ""])
    one, two = decoded.segments["1"], decoded.segments["2"]
    assert one.parts == [(batch, 0, 1), (batch, 3, 4)] and (one.rows, one.weight) == (2, 2)
    assert two.parts == [(batch, 1, 3)] and two.rows == 2
    assert (one.first, one.last) == (made[0].time.ToNanoseconds() / 1e9, made[2].time.ToNanoseconds() / 1e9)
    assert np.isclose(two.first, made[1].time.ToNanoseconds() / 1e9)


@pytest.mark.parametrize("files", [{"reference.npz": dump_reference(SyntheticWorld(Task.BINARY, seed=5).reference(500)),
                                    "monitoring.yaml": CONFIG + b"rules: [{name: low, signal: score, under: 2.0, "
                                                                b"for: 2}]\n"}])
async def test_a_rules_for_is_counted_per_segment(scorer) -> None:
    """A rule breached on every window (a score is under 2): line 1's first window and line 2's first do
    not make two in a row; line 1's second raises line 1's alert alone."""
    from opml_monitoring_scorer.core.decode import Batch

    monitored = scorer.get("m/1")
    rows = Batch.concat([scorer.decode(monitored, prediction(i)) for i in range(10)])

    async def close(segment: str, index: int) -> list:
        before = len(scorer.emitter.messages)
        await scorer.score_window("m/1", index, rows, 0.0, 1.0, segment=segment)
        return [m for m in scorer.emitter.messages[before:] if type(m).__name__ == "AlertRaised"]

    assert await close("1", 0) == []
    assert await close("2", 0) == [], "line 2's first breach, not the second in a row"
    (raised,) = await close("1", 1)
    assert (raised.rule, raised.segment, raised.evidence.window) == ("low", "1", 1)
    assert await close("", 0) == [], "the version's own windows count apart too"
    (alert,) = await scorer.store.alerts("m/1#1", below=None, limit=10)
    assert (alert.segment, alert.firing) == ("1", True)
    assert await scorer.store.firing("m/1#2") == [] and await scorer.store.firing("m/1") == []
