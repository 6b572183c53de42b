"""The MPP recalibrated from live labels on drifted streams of a real model: labels that show where
the model now errs must lower its error on the windows that follow, and labels that show nothing new
must not raise it (pure logic, no broker)."""

from __future__ import annotations

import numpy as np
from sklearn.datasets import make_classification
from sklearn.linear_model import LogisticRegression

from opml_monitoring_scorer.core.mpp import MPP
from opml_monitoring_scorer.core.reference import Outputs, ReferenceSet, Task, performance

Rows = tuple[dict[str, np.ndarray], Outputs, np.ndarray]


def drifted_stream(seed: int, labelled: int, relabelled: float) -> tuple[ReferenceSet, Rows, list[Rows]]:
    """A logistic regression, its reference (2,000 held-out rows), ``labelled`` live rows whose labels
    arrive, and three later windows of 1,000: the live rows resampled toward high ``f0`` (covariate
    shift) and, where ``f1`` > 0.5, a ``relabelled`` share of their labels flipped (concept shift).
    The labelled rows and the later windows are drawn from disjoint rows."""
    x, y = make_classification(n_samples=12_000, n_features=8, n_informative=5, flip_y=0.03, class_sep=1.0,
                               random_state=seed)
    rng = np.random.default_rng(seed)
    model = LogisticRegression().fit(x[:3000], y[:3000])

    def rows(index: np.ndarray, relabelled: float) -> Rows:
        scores = model.predict_proba(x[index])
        labels = y[index].astype(np.float64)
        flip = (x[index, 1] > 0.5) & (rng.random(len(index)) < relabelled)
        labels[flip] = 1 - labels[flip]
        return ({f"f{i}": x[index, i] for i in range(x.shape[1])},
                Outputs(scores.argmax(axis=1).astype(np.float64), scores[:, 1:]), labels)

    features, outputs, labels = rows(np.arange(3000, 5000), 0.0)
    reference = ReferenceSet.build(task=Task.BINARY, features=features, predicted=outputs.predicted,
                                   scores=outputs.scores, labels=labels)

    def shifted(pool: np.ndarray, size: int) -> np.ndarray:
        weights = np.exp(1.2 * x[pool, 0])
        return rng.choice(pool, size, p=weights / weights.sum())

    live = rows(shifted(np.arange(5000, 8500), labelled), relabelled)
    later = [rows(shifted(np.arange(8500, 12_000), 1000), relabelled) for _ in range(3)]
    return reference, live, later


def errors(stream: tuple[ReferenceSet, Rows, list[Rows]], labelled: int) -> tuple[float, float]:
    """Mean |estimate - truth| over the later windows before and after the live labels' recalibration."""
    reference, live, later = stream
    mpp = MPP(reference, min_labels=labelled)

    def error() -> float:
        return float(np.mean([abs(mpp.estimate(f, o) - performance(Task.BINARY, o.predicted, y))
                              for f, o, y in later]))

    before = error()
    mpp.add_labels(*live)
    mpp.recalibrate()
    return before, error()


def test_labels_that_show_a_concept_shift_lower_the_error() -> None:
    before, after = errors(drifted_stream(seed=1, labelled=300, relabelled=0.3), 300)
    assert before > 0.1, "the label-free estimate misses the concept shift"
    assert after < before / 2, (before, after)


def test_labels_that_show_nothing_new_do_not_raise_the_error() -> None:
    """A covariate shift only: 300 labels teach the MPP nothing the reference did not. The refit that
    kept the reference at a tenth of the live rows' weight, replacing the estimator whatever it
    scored, raised the error here from 0.011 to 0.019."""
    before, after = errors(drifted_stream(seed=0, labelled=300, relabelled=0.0), 300)
    assert after <= before + 0.001, (before, after)
