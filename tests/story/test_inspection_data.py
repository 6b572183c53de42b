"""The story's synthetic inspection data has what the story needs: classes a model can learn on every
line, lines that differ, a lighting change that costs a model accuracy, and spans that are the same
bytes for the same day (so re-ingesting a day changes nothing)."""

import csv
import io
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from inspection_data import CLASSES, FEATURES, LINES, inspection_patches, span_csv, span_features  # noqa: E402


def _rows(seed: int, count: int, *, lighting: dict[int, float] | None = None):
    parts = [inspection_patches(count, seed, line=line, lighting=(lighting or {}).get(line, 1.0)) for line in LINES]
    return (np.concatenate([span_features(images) for images, _ in parts]),
            np.concatenate([labels for _, labels in parts]))


@pytest.fixture(scope="module")
def model() -> LogisticRegression:
    x, y = _rows(seed=1, count=400)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return LogisticRegression(max_iter=300).fit(x, y)


def test_every_line_is_learnable_and_a_dimmed_lamp_costs_accuracy(model):
    for line in LINES:
        images, labels = inspection_patches(300, seed=2, line=line)
        dimmed, dimmed_labels = inspection_patches(300, seed=2, line=line, lighting=0.6)
        lit = model.score(span_features(images), labels)
        assert lit > 0.65, f"line {line}: {lit:.2f} accuracy where the lamps are as trained"
        assert model.score(span_features(dimmed), dimmed_labels) < lit - 0.15, f"line {line}"


def test_classes_are_balanced_and_lines_differ():
    images = {line: inspection_patches(400, seed=5, line=line) for line in LINES}
    for _, labels in images.values():
        assert np.bincount(labels, minlength=CLASSES).min() > 400 / CLASSES * 0.7
    means = [float(patches.mean()) for patches, _ in images.values()]
    assert len({round(m, 2) for m in means}) == len(LINES)


def test_a_span_is_the_same_bytes_for_the_same_day_and_holds_its_rows():
    first = span_csv(3, day=7, count=50)
    assert first == span_csv(3, day=7, count=50)
    assert first != span_csv(3, day=8, count=50) != span_csv(3, day=7, count=50, lighting=0.6)
    rows = list(csv.DictReader(io.StringIO(first.decode())))
    assert len(rows) == 50 and list(rows[0]) == ["line", "day", "label", *FEATURES]
    assert {row["line"] for row in rows} == {"3"} and all(0 <= float(row["p000"]) <= 1 for row in rows)
