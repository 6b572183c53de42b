"""A segment's own reference (reference.npz's ``segment.<parameter>`` column): the column is checked and
loaded, and a segment's windows are judged against its value's reference rows (drift baselines,
calibration, MPP), so lines whose inputs differ by design do not drift against each other; a segment
with too few reference rows falls back to the whole reference and the status says so."""

from __future__ import annotations

import io
import uuid

import numpy as np
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from opml_common.errors import InvalidArgument
from opml_common.events import RecordingEmitter
from opml_common.metrics import ServiceMetrics
from opml_monitoring_scorer.core.decode import Batch
from opml_monitoring_scorer.core.reference import Outputs
from opml_monitoring_scorer.core.scorer import MIN_SEGMENT_ROWS, Scorer, load_reference
from opml_monitoring_scorer.metrics import ScorerMetrics
from opml_monitoring_scorer.state import MonitorStore
from opml_monitoring_scorer_contract.reference import MAX_SEGMENT_VALUE_CHARS, reference_npz

CONFIG = b"features: {x: [x0, x1]}\nwindow: {count: 10}\nsegment: {parameter: line}\n"
LEVEL = {"1": 0.0, "2": 4.0, "3": 8.0}
"""Each line's input level: line 2's inputs sit far from line 1's, by design."""


def rows_of(line: str, n: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Features, scores ([n, 2]) and labels of ``n`` rows of ``line``: the model is right ~80 %."""
    rng = np.random.default_rng(seed)
    x = rng.normal(LEVEL[line], 1.0, (n, 2))
    p = 1.0 / (1.0 + np.exp(-2.0 * (x[:, 0] - LEVEL[line])))
    labels = (rng.uniform(size=n) < p).astype(np.int64)
    return {"x0": x[:, 0], "x1": x[:, 1]}, np.column_stack([1 - p, p]), labels


def reference_file(per_line: dict[str, int]) -> bytes:
    parts = [(line, *rows_of(line, n, seed=i)) for i, (line, n) in enumerate(per_line.items())]
    features = {name: np.concatenate([f[name] for _, f, _, _ in parts]) for name in ("x0", "x1")}
    scores = np.concatenate([s for _, _, s, _ in parts])
    return reference_npz(features, predicted=scores.argmax(axis=1), scores=scores,
                         labels=np.concatenate([y for *_, y in parts]),
                         segments={"line": np.concatenate([[line] * n for line, n in per_line.items()])})


def test_segment_columns_are_written_loaded_and_select_their_rows() -> None:
    reference = load_reference(reference_file({"1": 150, "2": 250}), task=None)

    assert list(reference.segments) == ["line"]
    line2 = reference.segment("line", "2")
    assert line2 is not None and len(line2) == 250 and line2.labels is not None and len(line2.labels) == 250
    assert np.mean(line2.features["x0"]) == pytest.approx(LEVEL["2"], abs=0.3)
    assert len(reference.segment("line", "7")) == 0
    assert reference.segment("shift", "1") is None, "no column of that parameter"


def test_wrong_segment_columns_are_named() -> None:
    features, scores, labels = rows_of("1", 120, seed=0)
    buffer = io.BytesIO()
    np.savez(buffer, **{"feature.x0": features["x0"], "predicted": scores.argmax(axis=1), "scores": scores,
                        "labels": labels, "segment.line": np.zeros((120, 2)), "segment.shift": np.array(["a"] * 7),
                        "segment.": np.array(["a"] * 120)})
    with pytest.raises(InvalidArgument) as raised:
        load_reference(buffer.getvalue(), task=None)
    assert sorted(field for field, _ in raised.value.violations) == [
        "reference.segment.line", "reference.segment.shift", "reference.segments"]

    with pytest.raises(ValueError, match="segment.line: a value longer than"):
        reference_npz(features, predicted=scores.argmax(axis=1), scores=scores,
                      segments={"line": ["x" * (MAX_SEGMENT_VALUE_CHARS + 1)] * 120})


def window(line: str, n: int, seed: int) -> Batch:
    features, scores, _ = rows_of(line, n, seed)
    return Batch(features, Outputs(scores.argmax(axis=1).astype(np.float64), scores), [""] * n)


@pytest.fixture
async def scorer():
    files = {"reference.npz": reference_file({"1": 400, "2": 400, "3": MIN_SEGMENT_ROWS - 1}),
             "monitoring.yaml": CONFIG}

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


async def test_each_line_is_judged_against_its_own_reference_rows(scorer: Scorer) -> None:
    rows = window("2", 2000, seed=11)
    own = await scorer.score_window("m/1", 0, rows, 0.0, 1.0, segment="2")
    whole = await scorer.score_window("m/1", 0, rows, 0.0, 1.0)

    assert max(d.distance for d in own.drift.values()) < 0.3, "line 2's clean rows against line 2's reference"
    assert min(d.distance for d in whole.drift.values()) > 0.3, "against every line's reference they drift"
    monitored = scorer.get("m/1")
    line2 = monitored.segments["2"]
    assert line2 is not monitored.monitor and len(line2.reference) == 400
    assert line2.quality is monitored.monitor.quality, "value ranges stay the whole reference's"
    _, scores, labels = rows_of("2", 2000, seed=11)
    assert own.cbpe == pytest.approx(np.mean(scores.argmax(axis=1) == labels), abs=0.04)
    assert (await scorer.find("m/1")).segments["2"].reference_performance == pytest.approx(
        np.mean(line2.reference.outputs.predicted == line2.reference.labels))


async def test_a_segment_with_too_few_reference_rows_falls_back_to_the_whole_reference(scorer: Scorer) -> None:
    await scorer.score_window("m/1", 0, window("1", 200, seed=3), 0.0, 1.0, segment="3")
    await scorer.score_window("m/1", 0, window("1", 200, seed=4), 0.0, 1.0, segment="9")

    monitored = scorer.get("m/1")
    assert monitored.segments["3"] is monitored.monitor and monitored.segments["9"] is monitored.monitor
    said = [text for text in monitored.limitations if text.startswith("segment ")]
    assert said == [f"segment 3: {MIN_SEGMENT_ROWS - 1} reference rows, fewer than {MIN_SEGMENT_ROWS}: judged "
                    "against the whole reference",
                    f"segment 9: 0 reference rows, fewer than {MIN_SEGMENT_ROWS}: judged against the whole reference"]
