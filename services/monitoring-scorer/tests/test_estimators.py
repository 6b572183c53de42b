"""The estimators on generated streams whose truth is known (pure logic, no broker)."""

from __future__ import annotations

import numpy as np
import pytest

from opml_common.errors import FailedPrecondition, InvalidArgument
from opml_monitoring_scorer.core.cbpe import ConfidenceEstimator
from opml_monitoring_scorer.core.config import MonitoringConfig
from opml_monitoring_scorer.core.decode import Batch
from opml_monitoring_scorer.core.monitor import ModelMonitor
from opml_monitoring_scorer.core.mpp import MPP
from opml_monitoring_scorer.core.reference import Outputs, ReferenceSet, Task, performance
from opml_monitoring_scorer.synthetic import SyntheticWorld


@pytest.mark.parametrize("task", [Task.BINARY, Task.MULTICLASS])
def test_label_free_accuracy_tracks_the_truth_on_clean_and_covariate_shifted_windows(task: Task) -> None:
    world = SyntheticWorld(task, seed=1)
    reference = world.reference(3000)
    mpp, cbpe = MPP(reference), ConfidenceEstimator(reference)
    errors = {"mpp": [], "cbpe": []}
    truths = []
    for shift in (None, None, np.array([1.5, 0, 0, 0]), np.array([0, -1.5, 0, 0])):
        rows = world.rows(2000, shift=shift)
        truth = performance(task, rows.outputs.predicted, rows.labels)
        truths.append(truth)
        errors["mpp"].append(abs(mpp.estimate(rows.features, rows.outputs) - truth))
        errors["cbpe"].append(abs(cbpe.estimate(rows.outputs) - truth))
    assert max(truths) - min(truths) > 0.03, "the shifts must move the true accuracy, else the test proves nothing"
    assert max(errors["cbpe"]) < 0.04, errors
    assert max(errors["mpp"]) < 0.05, errors


def test_cbpe_calibration_fixes_an_overconfident_model() -> None:
    world = SyntheticWorld(Task.BINARY, seed=2)
    reference = world.reference(4000)
    p = reference.outputs.scores[:, 0]
    sharpened = 1 / (1 + np.exp(-3 * np.log(p / (1 - p))))  # the same ranking, far too confident
    overconfident = ReferenceSet.build(task=Task.BINARY, features=reference.features,
                                       predicted=reference.outputs.predicted, scores=sharpened,
                                       labels=reference.labels)
    rows = world.rows(3000)
    q = rows.outputs.scores[:, 0]
    rows.outputs.scores = (1 / (1 + np.exp(-3 * np.log(q / (1 - q)))))[:, None]
    truth = performance(Task.BINARY, rows.outputs.predicted, rows.labels)
    raw = float(np.mean(rows.outputs.confidence()))
    estimate = ConfidenceEstimator(overconfident).estimate(rows.outputs)
    assert raw - truth > 0.04, "the uncalibrated confidence overstates accuracy"
    assert abs(estimate - truth) < 0.03


def test_a_multiclass_estimate_falls_when_every_class_score_flattens() -> None:
    """A change that makes the model less sure of every class (a dimmed lamp): the rows' class scores move
    toward uniform and the model is right less often, and the estimate falls with the truth (on the
    story's line 3 the one-against-the-rest calibrations, normalized, rose instead)."""
    rng = np.random.default_rng(4)

    def rows(n: int, flatten: float) -> tuple[np.ndarray, np.ndarray]:
        logits = rng.normal(0, 2.0, (n, 4))
        scores = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
        scores = (1 - flatten) * scores + flatten / 4  # calibrated: the labels are drawn from them
        labels = (scores.cumsum(axis=1) < rng.uniform(size=(n, 1))).sum(axis=1)
        return scores, labels

    scores, labels = rows(3000, 0.0)
    reference = ReferenceSet.build(task=Task.MULTICLASS, features={"x": scores[:, 0]}, predicted=scores.argmax(axis=1),
                                   scores=scores, labels=labels)
    cbpe = ConfidenceEstimator(reference)
    estimates, truths = [], []
    for flatten in (0.0, 0.5):
        scores, labels = rows(3000, flatten)
        outputs = Outputs(scores.argmax(axis=1).astype(np.float64), scores)
        estimates.append(cbpe.estimate(outputs))
        truths.append(performance(Task.MULTICLASS, outputs.predicted, labels))
    assert truths[0] - truths[1] > 0.1, truths
    assert estimates[0] - estimates[1] > 0.05, (estimates, truths)
    assert abs(estimates[0] - truths[0]) < 0.03


def test_concept_shift_is_missed_without_labels_and_caught_after_mpp_recalibration() -> None:
    world = SyntheticWorld(Task.BINARY, seed=3)
    reference = world.reference(3000)
    mpp, cbpe = MPP(reference, min_labels=500), ConfidenceEstimator(reference)
    world.flipped = True
    labelled = world.rows(3000)
    live = world.rows(3000)
    truth = performance(Task.BINARY, live.outputs.predicted, live.labels)
    before = mpp.estimate(live.features, live.outputs)
    assert cbpe.estimate(live.outputs) - truth > 0.15 and before - truth > 0.15, "label-free estimates miss it"
    mpp.add_labels(labelled.features, labelled.outputs, labelled.labels)
    assert mpp.recalibrate()
    after = mpp.estimate(live.features, live.outputs)
    assert abs(after - truth) < 0.05, (before, after, truth)


@pytest.mark.parametrize(("rows", "wrong"), [(500, 1), (500, 2), (12_000, 1), (12_000, 2)])
def test_mpp_learns_from_a_reference_with_fewer_errors_than_calibration_folds(rows: int, wrong: int) -> None:
    """A model wrong on one or two reference rows used to fail its registration (3-fold calibration
    needs three of each outcome), and a refit with such labels failed at every label after."""
    world = SyntheticWorld(Task.BINARY, seed=4)
    reference = world.reference(rows)
    labels = reference.outputs.predicted.copy()
    labels[:wrong] = 1 - labels[:wrong]
    reference.labels = labels
    mpp = MPP(reference, min_labels=100)
    live = world.rows(1000)
    assert mpp.estimate(live.features, live.outputs) > 0.95
    mpp.add_labels(live.features, live.outputs, live.outputs.predicted)  # right on every live row
    mpp.recalibrate()
    assert mpp.refits >= 1, "the candidates were fitted (kept or not, by their held-out score)"
    assert mpp.estimate(live.features, live.outputs) > 0.95


def test_regression_mpp_estimates_the_mae_where_the_error_depends_on_the_inputs() -> None:
    world = SyntheticWorld(Task.REGRESSION, seed=4)
    reference = world.reference(4000)
    mpp = MPP(reference)
    clean, noisy = world.rows(3000), world.rows(3000, shift=np.array([0, 1.5, 0, 0]))
    for rows in (clean, noisy):
        truth = performance(Task.REGRESSION, rows.outputs.predicted, rows.labels)
        assert abs(mpp.estimate(rows.features, rows.outputs) - truth) / truth < 0.1
    assert performance(Task.REGRESSION, noisy.outputs.predicted, noisy.labels) > 1.4 * reference.performance()


def test_monitor_scores_a_clean_window_high_and_a_shifted_one_lower_with_its_parts() -> None:
    world = SyntheticWorld(Task.MULTICLASS, seed=5)
    monitor = ModelMonitor(world.reference(3000), MonitoringConfig())
    def window(rows, index):
        batch = Batch(rows.features, rows.outputs, [str(i) for i in range(len(rows.outputs))])
        return monitor.score(batch, index=index, first_time=0.0, last_time=1.0)
    clean = window(world.rows(1000), 0)
    shifted = window(world.rows(1000, shift=np.array([2.0, 0, 0, 0]), cat_p=(0.1, 0.1, 0.8)), 1)
    assert clean.score > 0.9 and not any(d.drifted for d in clean.drift.values() if d.feature != "x0")
    assert shifted.drift["x0"].drifted and shifted.drift["color"].drifted
    assert not shifted.drift["x1"].drifted
    assert shifted.score < clean.score - 0.2
    assert set(shifted.parts) == {"performance", "drift", "output", "data_quality"}


def test_reference_without_labels_is_monitored_for_drift_only_and_says_so() -> None:
    world = SyntheticWorld(Task.BINARY, seed=6)
    rows = world.rows(500)
    reference = ReferenceSet.build(task=Task.BINARY, features=rows.features, predicted=rows.outputs.predicted,
                                   scores=rows.outputs.scores)
    monitor = ModelMonitor(reference, MonitoringConfig())
    assert monitor.mpp is None and monitor.cbpe is None and "no labels" in monitor.limitations[0]
    live = world.rows(300)
    score = monitor.score(Batch(live.features, live.outputs, ["r"] * len(live.outputs)), index=0,
                          first_time=0, last_time=0)
    assert score.mpp is None and "performance" not in score.parts and score.drift
    with pytest.raises(FailedPrecondition):
        MPP(reference)


def test_reference_build_reports_every_problem_at_once() -> None:
    with pytest.raises(InvalidArgument) as caught:
        ReferenceSet.build(task=Task.BINARY, features={"a": np.zeros(10), "b": np.zeros(9)},
                           predicted=np.zeros(10), labels=np.zeros(8))
    fields = [field for field, _ in caught.value.violations]
    assert fields == ["reference.features[b]", "reference.outputs", "reference.labels", "reference.scores"]


def test_reference_build_names_class_names_where_class_indexes_belong() -> None:
    names = np.array(["cat", "dog"] * 60)
    with pytest.raises(InvalidArgument) as caught:
        ReferenceSet.build(task=Task.BINARY, features={"a": np.zeros(120)}, predicted=names,
                           scores=np.full((120, 2), 0.5), labels=names)
    assert [field for field, _ in caught.value.violations] == ["reference.predicted", "reference.labels"]
    assert "class names" in caught.value.message
