"""Drift and data quality of summary-only predictions (no broker): the router's summaries of live
requests compared with the reference summarised in groups of the requests' batch size."""

from __future__ import annotations

import numpy as np
import pytest
from opml.inference.v1 import events_pb2
from tritonclient.grpc import service_pb2 as pb

from opml_common.kserve_codec import encode_outputs, encode_request
from opml_inference_router_contract.predictions import tensor_summaries
from opml_monitoring_scorer.core.config import MonitoringConfig
from opml_monitoring_scorer.core.decode import Batch, decode_prediction
from opml_monitoring_scorer.core.monitor import ModelMonitor
from opml_monitoring_scorer.core.reference import ReferenceSet, Task
from opml_monitoring_scorer.core.summary import MIN_GROUPS, STATS, SummaryDrift, TensorStats, summary_of
from opml_monitoring_scorer.synthetic import FEATURES, SyntheticWorld

NAMES = {"x": list(FEATURES)}


@pytest.fixture
def world() -> SyntheticWorld:
    return SyntheticWorld(Task.BINARY, seed=5)


@pytest.fixture
def monitor(world: SyntheticWorld) -> ModelMonitor:
    return ModelMonitor(world.reference(3000), MonitoringConfig(feature_names=NAMES))


def assert_clean(drift: dict) -> None:
    """No statistic drifted beyond chance: KS at p < 0.05 fires on about one clean window in twenty
    per statistic by design (Evidently's default), so a clean sample is one whose KS p-values are not
    small (a shift, or the wrong batch size, gives p < 1e-6 below)."""
    assert all(d.method == "ks" and d.statistic > 1e-3 for d in drift.values()), \
        {n: (d.statistic, d.distance) for n, d in drift.items()}


def summarised(world: SyntheticWorld, requests: int, rows: int, *, shift: np.ndarray | None = None,
               respond: bool = False) -> list[events_pb2.PredictionMade]:
    """Summary-only PredictionMade events as the router makes them over its record cap (its contract's
    ``tensor_summaries``); ``respond``: the request recorded, only the response summarised."""
    live = world.rows(requests * rows, shift=shift)
    x = np.column_stack([live.features[f] for f in FEATURES]).astype(np.float32)
    color = np.array([[c.encode()] for c in live.features["color"]], dtype=object)
    scores = live.outputs.class_scores().astype(np.float32)
    events = []
    for i in range(requests):
        at = slice(i * rows, (i + 1) * rows)
        request = encode_request("m", {"x": x[at], "color": color[at]}, request_id=f"r{i}")
        response = encode_outputs(pb.ModelInferResponse(id=f"r{i}"), {"probabilities": scores[at]})
        event = events_pb2.PredictionMade(request_id=f"r{i}", model_name="m", model_version="1")
        event.output_summaries.extend(tensor_summaries(response.outputs, response.raw_output_contents))
        if respond:
            event.infer_request = request.SerializeToString()
        else:
            event.input_summaries.extend(tensor_summaries(request.inputs, request.raw_input_contents))
        events.append(event)
    return events


def measured(monitor: ModelMonitor, events: list[events_pb2.PredictionMade]) -> tuple[dict, list[str]]:
    return monitor.summary_drift.measure([summary_of(e) for e in events])


def test_reference_like_summaries_do_not_drift_and_shifted_ones_do(world, monitor) -> None:
    drift, unscored = measured(monitor, summarised(world, 200, 10))
    assert sorted(drift) == [f"summary:x.{s}" for s in sorted(STATS)] and unscored == []
    assert_clean(drift)  # 300 reference groups of 10 rows: Evidently's KS
    assert max(d.distance for d in drift.values()) < 0.5, "under the stream test's summary drift rule"

    shifted, _ = measured(monitor, summarised(world, 200, 10, shift=np.array([2.0, 0, 0, 0])))
    assert shifted["summary:x.mean"].statistic < 1e-6 and shifted["summary:x.mean"].distance > 1.0
    assert shifted["summary:x.max"].statistic < 1e-6


def test_a_recorded_request_with_a_summarised_response_is_summarised_the_same(world, monitor) -> None:
    recorded = summarised(world, 5, 10, respond=True)
    for event in recorded:
        request = pb.ModelInferRequest.FromString(event.infer_request)
        (by_router, _) = tensor_summaries(request.inputs, request.raw_input_contents)
        ours = summary_of(event).tensors["x"]
        assert ours.rows == 10
        assert [ours.value(s) for s in STATS] == pytest.approx([getattr(by_router, s) for s in STATS])
    drift, _ = measured(monitor, summarised(world, 200, 10, respond=True))
    assert_clean(drift)


def test_batch_sizes_are_respected(world, monitor) -> None:
    sizes = monitor.summary_drift
    assert sizes.reference_stats("x", 50)["min"].mean() < sizes.reference_stats("x", 10)["min"].mean() - 0.5
    assert len(sizes.reference_stats("x", 50)["min"]) == 3000 // 50

    # requests of 50 rows are compared with reference groups of 50: no drift, though their min and max
    # are far from those of 10 rows
    fifty = [summary_of(e) for e in summarised(world, 100, 50)]
    drift, _ = sizes.measure(fifty)
    assert_clean(drift)
    # the same statistics said to be of 10-row requests are compared with groups of 10: they drift
    relabelled = [type(s)(rows=10, tensors={"x": TensorStats(10, *(s.tensors["x"].value(k) for k in STATS))})
                  for s in fifty]
    wrong, _ = sizes.measure(relabelled)
    assert wrong["summary:x.min"].statistic < 1e-6 and wrong["summary:x.max"].statistic < 1e-6, wrong

    # a window of both sizes is compared with the mixture of both sizes' groups
    mixed, _ = sizes.measure(fifty[:40] + [summary_of(e) for e in summarised(world, 160, 10)])
    assert_clean(mixed)

    # a request larger than the reference allows MIN_GROUPS groups of is not compared, and says so
    large = 3000 // MIN_GROUPS + 1
    drift, unscored = sizes.measure([summary_of(e) for e in summarised(world, 3, large)])
    assert drift == {} and unscored == ["x"]


def test_a_wide_tensors_reference_row_statistics_give_the_exact_group_statistics() -> None:
    rng = np.random.default_rng(3)
    images = rng.gamma(2.0, size=(400, 300))
    request = encode_request("m", {"img": images.astype(np.float32)})
    response = encode_outputs(pb.ModelInferResponse(), {"probabilities": np.full((400, 2), 0.5, np.float32)})
    decoded = decode_prediction(events_pb2.PredictionMade(infer_request=request.SerializeToString(),
                                                          infer_response=response.SerializeToString()),
                                task=Task.BINARY, feature_names={})
    assert sorted(decoded.features) == ["img.max", "img.mean", "img.min", "img.std"]
    drift = SummaryDrift(decoded.features, {})
    order = drift._order["img"]
    got = drift.reference_stats("img", 8)
    direct = images.astype(np.float32).astype(np.float64)[order[:400]].reshape(50, -1)
    assert got["mean"] == pytest.approx(direct.mean(axis=1))
    assert got["std"] == pytest.approx(direct.std(axis=1))
    assert got["min"] == pytest.approx(direct.min(axis=1)) and got["max"] == pytest.approx(direct.max(axis=1))


def test_a_window_of_summaries_only_is_scored_on_drift_and_data_quality(world, monitor) -> None:
    clean = Batch.concat([decode_prediction(e, task=Task.BINARY, feature_names=NAMES)
                          for e in summarised(world, 200, 10)])
    assert (len(clean), clean.summary_only, len(clean.summaries)) == (0, 200, 200)
    score = monitor.score(clean, index=0, first_time=0.0, last_time=1.0)
    assert score.mpp is None and score.cbpe is None and score.output_drift is None
    assert sorted(score.parts) == ["data_quality", "drift"]
    assert score.score == pytest.approx(score.parts["drift"] * score.parts["data_quality"]) and score.score > 0.7
    assert "summary_only" in score.flags and "no_estimate:summary_only" in score.flags
    assert "summary:x.mean" in score.drift_signals()

    shifted = Batch.concat([decode_prediction(e, task=Task.BINARY, feature_names=NAMES)
                            for e in summarised(world, 200, 10, shift=np.array([6.0, 0, 0, 0]))])
    score = monitor.score(shifted, index=1, first_time=1.0, last_time=2.0)
    assert score.parts["drift"] < 1.0 and score.drift["summary:x.mean"].drifted
    # x0 shifted by 6 standard deviations: most requests' max is past the reference's range
    assert score.data_quality.summary_out_of_range["x"] > 0.5 and "summary_out_of_range:x" in score.flags
    assert score.data_quality.bad_rows_share == pytest.approx(score.data_quality.summary_out_of_range["x"])
    assert score.parts["data_quality"] < 0.5


def test_summaries_missing_a_reference_tensor_are_bad_rows_beside_clean_rows(world) -> None:
    reference = world.reference(1000)
    monitor = ModelMonitor(ReferenceSet.build(task=Task.BINARY, features=reference.features,
                                              predicted=reference.outputs.predicted, scores=reference.outputs.scores,
                                              labels=reference.labels), MonitoringConfig(feature_names=NAMES))
    no_x = events_pb2.PredictionMade(request_id="big", model_name="m", model_version="1")
    no_x.input_summaries.add(name="color", datatype="BYTES", shape=[30, 1])
    live = world.rows(70)
    x = np.column_stack([live.features[f] for f in FEATURES]).astype(np.float32)
    request = encode_request("m", {"x": x, "color": np.array([[c.encode()] for c in live.features["color"]],
                                                               dtype=object)})
    response = encode_outputs(pb.ModelInferResponse(),
                              {"probabilities": live.outputs.class_scores().astype(np.float32)})
    rows = decode_prediction(events_pb2.PredictionMade(request_id="r", infer_request=request.SerializeToString(),
                                                       infer_response=response.SerializeToString()),
                             task=Task.BINARY, feature_names=NAMES)
    batch = Batch.concat([rows, decode_prediction(no_x, task=Task.BINARY, feature_names=NAMES)])
    quality = monitor.quality.check(batch.features, len(batch), summary_only=batch.summary_only,
                                    summaries=batch.summaries, tensors=monitor.summary_drift.ranges)
    assert quality.summary_missing == {"x": 1.0} and "summary_missing:x" in quality.flags()
    clean_rows = 70 * (1 - monitor.quality.check(batch.features, 70).bad_rows_share)
    assert quality.bad_rows_share == pytest.approx((70 - clean_rows + 30) / 100)
