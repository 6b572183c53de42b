"""Per-segment monitoring through the real broker: a version monitored with ``segment: {parameter: line}``
serves two production lines in the same records (the router's PredictionBatch, one-row requests each
with its request parameter ``line``); line 2's inputs drift and its predictions turn unsure and wrong
while line 1 stays clean. Only line 2's estimate falls, only its rules fire, and its alerts carry the
segment; line 1 raises nothing; the late labels give each line's truth in its own windows. The test
syncs on the scorer's events (WindowScored on opml.quality.v1, AlertRaised on opml.alerts.v1)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer
from opml.inference.v1 import events_pb2 as inference_events
from opml.monitoring.v1 import alert_events_pb2, quality_events_pb2
from tritonclient.grpc import service_pb2 as pb

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.bus.cloudevents import CloudEvent
from opml_common.bus.security import kafka_client_kwargs
from opml_common.config import PlatformSettings
from opml_devstack.testing.services import TOKENS
from opml_monitoring_scorer.core.scorer import dump_reference
from opml_monitoring_scorer.synthetic import FEATURES, Rows, SyntheticWorld
from opml_monitoring_scorer_contract.topics import ALERTS, QUALITY

from .conftest import Producer, writer

pytestmark = pytest.mark.timeout(600)

WINDOW = 200
PER_RECORD = 100
CONFIG = f"""
features: {{x: [{", ".join(FEATURES)}]}}
outputs: {{scores: probabilities}}
window: {{count: {WINDOW}}}
segment: {{parameter: line}}
rules:
  - {{name: accuracy, signal: cbpe, under: 0.75, for: 2}}
  - {{name: drift, signal: drift, over: 0.25, features: [x0], for: 2}}
"""


async def queue_lines(producer: Producer, rows: Rows, lines: list[str | None]) -> None:
    """One-row requests, row i on production line ``lines[i]`` (its request parameter ``line``; None:
    without it), in PredictionBatch records of ``PER_RECORD`` in the order given."""
    x = np.column_stack([rows.features[f] for f in FEATURES]).astype(np.float32)
    color = rows.features["color"].astype(object)
    scores = rows.outputs.class_scores().astype(np.float32)
    for first in range(0, len(lines), PER_RECORD):
        batch = inference_events.PredictionBatch()
        for i in range(first, min(first + PER_RECORD, len(lines))):
            request_id = f"{producer.ids}-{producer.sent}"
            made = producer.prediction(request_id, {"x": x[i:i + 1], "color": np.array([[color[i].encode()]],
                                                                                        dtype=object)},
                                       scores[i:i + 1], into=batch.predictions.add())
            if lines[i] is not None:
                request = pb.ModelInferRequest.FromString(made.infer_request)
                request.parameters["line"].string_param = lines[i]
                made.infer_request = request.SerializeToString()
            producer.labels[request_id] = [float(rows.labels[i])]
            producer.sent += 1
        await producer.publish(batch)


def interleaved(one: Rows, two: Rows) -> tuple[Rows, list[str]]:
    """Rows of line 1 and line 2 alternating (each record holds half of each)."""
    order = np.empty(2 * len(one.labels), dtype=int)
    order[0::2], order[1::2] = np.arange(len(one.labels)), len(one.labels) + np.arange(len(two.labels))
    both = concat(one, two)
    return take(both, order), ["1", "2"] * len(one.labels)


def concat(a: Rows, b: Rows) -> Rows:
    from opml_monitoring_scorer.core.reference import Outputs

    return Rows({k: np.concatenate([a.features[k], b.features[k]]) for k in a.features},
                Outputs(np.concatenate([a.outputs.predicted, b.outputs.predicted]),
                        np.concatenate([a.outputs.scores, b.outputs.scores])),
                np.concatenate([a.labels, b.labels]))


def take(rows: Rows, index: np.ndarray) -> Rows:
    from opml_monitoring_scorer.core.reference import Outputs

    return Rows({k: v[index] for k, v in rows.features.items()},
                Outputs(rows.outputs.predicted[index], rows.outputs.scores[index]), rows.labels[index])


def unsure_drifted(world: SyntheticWorld, n: int) -> Rows:
    """Line 2 gone wrong: x0 shifted by 2 and only the rows the model is unsure of (P near 0.5), so its
    confidence and its accuracy both fall."""
    rows = world.rows(n * 20, shift=np.array([2.0, 0, 0, 0]))
    p = rows.outputs.class_scores()[:, 1]
    unsure = np.flatnonzero(np.abs(p - 0.5) < 0.1)
    assert len(unsure) >= n, len(unsure)
    return take(rows, unsure[:n])


class Events:
    """The scorer's WindowScored and alert events, read from the beginning of their topics as they come."""

    def __init__(self, settings: PlatformSettings) -> None:
        self.consumer = AIOKafkaConsumer(QUALITY.full_name(settings.topic_prefix), ALERTS.full_name(settings.topic_prefix),
                                         **kafka_client_kwargs(settings), group_id=None, auto_offset_reset="earliest",
                                         enable_auto_commit=False)
        self.windows: dict[tuple[str, int], quality_events_pb2.WindowScored] = {}
        self.raised: list[alert_events_pb2.AlertRaised] = []

    async def __aenter__(self) -> Events:
        await self.consumer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.consumer.stop()

    async def until(self, done, *, what: str, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, (f"{what}: not seen in {timeout_s}s; windows (labelled) "
                                                 f"{ {k: w.labelled for k, w in sorted(self.windows.items())} }")
            for part in (await self.consumer.getmany(timeout_ms=500)).values():
                for record in part:
                    event = CloudEvent.from_kafka(record.headers, record.value)
                    if event.type == quality_events_pb2.WindowScored.DESCRIPTOR.full_name:
                        scored = event.parse(quality_events_pb2.WindowScored)
                        kept = self.windows.get((scored.segment, scored.window))
                        if kept is None or scored.labelled >= kept.labelled:
                            self.windows[scored.segment, scored.window] = scored
                    elif event.type == alert_events_pb2.AlertRaised.DESCRIPTOR.full_name:
                        self.raised.append(event.parse(alert_events_pb2.AlertRaised))


async def test_only_the_drifting_lines_estimate_falls_and_only_its_alerts_are_raised(stack, world, platform_settings):
    with BundleStoreClient(stack.store.target, token=TOKENS["writer"]) as bundles:
        bundles.add(stack.context, "segmented", {"reference.npz": dump_reference(world.reference(3000)),
                                                 "monitoring.yaml": CONFIG.encode()}, commit=True)
    scorer = stack.scorer().start()
    with writer(scorer) as client:
        status = client.register("fraud", "1", stack.context, "segmented")
        assert status.segment_parameter == "line"
        async with Producer(platform_settings) as producer, Events(platform_settings) as events:
            clean, lines = interleaved(world.rows(2 * WINDOW), world.rows(2 * WINDOW))
            await queue_lines(producer, clean, lines)  # windows 0-1 of each line, 0-3 of the version
            good, bad = world.rows(3 * WINDOW), unsure_drifted(world, 3 * WINDOW)
            mixed, lines = interleaved(good, bad)
            await queue_lines(producer, mixed, lines)  # windows 2-4 of each line, 4-9 of the version
            # a record of predictions of no line closes the version's window 10 after every line's last
            # window: once it is announced, every line's windows are scored and their rules stepped
            await queue_lines(producer, world.rows(2 * PER_RECORD), [None] * (2 * PER_RECORD))
            await events.until(lambda: ("", 10) in events.windows, what="the version's window 10")
            await events.until(lambda: {(a.segment, a.rule) for a in events.raised} >= {("2", "accuracy"),
                                                                                        ("2", "drift")},
                               what="line 2's alerts")

            one = [events.windows["1", i] for i in range(5)]
            two = [events.windows["2", i] for i in range(5)]
            assert all(w.rows == WINDOW and w.estimator == "cbpe" for w in one + two)
            assert min(w.estimate for w in one) > 0.77, [w.estimate for w in one]  # the model's 0.83
            assert min(w.estimate for w in two[:2]) > 0.77, "line 2 was clean at first"
            assert max(w.estimate for w in two[2:]) < 0.65, [w.estimate for w in two]  # unsure: about 0.55
            assert ("1", 5) not in events.windows and ("2", 5) not in events.windows
            assert events.windows["", 10].rows == 2 * PER_RECORD

            raised = {(a.segment, a.rule): a for a in events.raised if a.segment}
            assert set(raised) == {("2", "accuracy"), ("2", "drift")}, "line 1 raised nothing"
            assert raised["2", "accuracy"].evidence.window == 3 and raised["2", "accuracy"].evidence.value < 0.65
            assert raised["2", "drift"].evidence.features["x0"] > 0.25
            assert {a.rule for a in client.alerts("fraud", "1", segment="2") if a.firing} == {"accuracy", "drift"}
            assert all(a.segment == "2" for a in client.alerts("fraud", "1", segment="2"))
            assert client.alerts("fraud", "1", segment="1") == []
            line = client.status("fraud", "1", segment="2")
            assert (line.windows, line.predictions, sorted(line.firing)) == (5, 5 * WINDOW, ["accuracy", "drift"])
            assert client.status("fraud", "1", segment="1").firing == []
            assert list(client.status("fraud", "1").segments) == ["1", "2"]
            assert [w.index for w in client.windows("fraud", "1", segment="2")] == [4, 3, 2, 1, 0]

            # the late labels of the lines' last windows (4): each line's window gets its own truth (fewer
            # labels, fewer of the MPP's recalibrations, each a few refits, on the labels' path)
            await producer.send_labels(list(producer.labels)[8 * WINDOW:10 * WINDOW])
            await events.until(lambda: all(events.windows[s, 4].labelled == WINDOW for s in "12"),
                               what="the lines' windows 4 labelled")
            truth = {s: events.windows[s, 4].true_value for s in "12"}
            assert truth["1"] > 0.7 and truth["2"] < 0.65, truth  # 0.83 and 0.53
            assert events.windows["", 8].labelled + events.windows["", 9].labelled == 2 * WINDOW
    scorer.stop()
