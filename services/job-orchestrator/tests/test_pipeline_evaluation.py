"""Evaluation: the config's validation, the metrics against their definitions, slicing, and the
blessing decision (value and change thresholds per slice, no thresholds, no baseline, small slices)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from opml_job_orchestrator.pipelines.evaluation import (
    NO_THRESHOLDS,
    OVERALL,
    EvaluationError,
    binary_auc,
    config_errors,
    judge,
    metric_values,
    parse_config,
    slice_masks,
)

BASE = {"label": "y", "features": ["a", "b"], "metrics": ["accuracy", "auc"]}


def _config(**changes: object):
    return parse_config(BASE | changes)


def test_config_errors_name_every_mistake_with_its_path() -> None:
    errors = config_errors({
        "label": "", "features": ["a", "a"], "metrics": ["accuracy", "f1", "mae"], "task": "binary",
        "min_rows": 0, "slices": "line", "thresholds": [
            {"metric": "auc", "lower": 0.5},
            {"metric": "accuracy", "lower": 0.9, "upper": 0.8},
            {"metric": "accuracy", "change": {"direction": "up"}},
            {"metric": "accuracy"},
        ], "extra": 1}, "pipeline.steps[3].evaluate")
    prefix = "pipeline.steps[3].evaluate"
    for expected in (f"{prefix}.extra: is not a setting", f"{prefix}.label: must be a column name",
                     f"{prefix}.features: a column appears twice", f"{prefix}.slices: must be a list",
                     f"{prefix}.min_rows: must be an integer >= 1", f"{prefix}.metrics[1]: must be one of",
                     f"{prefix}.metrics[2]: mae is not defined for a binary model",
                     f"{prefix}.thresholds[0].metric: must be one of the step's metrics",
                     f"{prefix}.thresholds[1]: lower (0.9) must be <= upper (0.8)",
                     f"{prefix}.thresholds[2].change.direction: must be one of",
                     f"{prefix}.thresholds[2].change: needs absolute and/or relative",
                     f"{prefix}.thresholds[3]: needs lower, upper and/or change"):
        assert any(error.startswith(expected) for error in errors), (expected, errors)
    assert len(errors) == 12
    assert config_errors(BASE | {"min_rows": 30.0}) == [], "a protobuf Struct carries 30 as 30.0"
    with pytest.raises(EvaluationError):
        parse_config({"label": "y"})


def test_change_direction_defaults_to_the_metric_s_natural_one() -> None:
    config = _config(metrics=["accuracy", "log_loss"], thresholds=[
        {"metric": "accuracy", "change": {"absolute": -0.01}}, {"metric": "log_loss", "change": {"relative": 0.1}}])
    assert [t.change.direction for t in config.thresholds] == ["higher_is_better", "lower_is_better"]


def test_classifier_metrics_against_their_definitions() -> None:
    labels = np.array([0, 1, 1, 0, 1])
    p1 = np.array([0.2, 0.9, 0.4, 0.6, 0.8])
    values = metric_values("binary", ["accuracy", "error_rate", "log_loss", "auc"], labels, np.stack([1 - p1, p1], 1))
    assert values["rows"] == 5
    assert values["accuracy"] == pytest.approx(3 / 5) and values["error_rate"] == pytest.approx(2 / 5)
    expected_loss = -np.mean(np.log([0.8, 0.9, 0.4, 0.4, 0.8]))
    assert values["log_loss"] == pytest.approx(expected_loss)
    pairs = [(p, n) for p, n in itertools.product(p1[labels == 1], p1[labels == 0])]
    assert values["auc"] == pytest.approx(np.mean([1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs]))
    single = metric_values("binary", ["accuracy", "auc"], labels, p1[:, None])
    assert single["accuracy"] == values["accuracy"] and single["auc"] == values["auc"]


def test_auc_counts_ties_half_and_needs_both_classes() -> None:
    assert binary_auc(np.array([0, 1, 0, 1]), np.array([0.5, 0.5, 0.5, 0.5])) == 0.5
    assert binary_auc(np.array([0, 0, 1]), np.array([0.1, 0.2, 0.3])) == 1.0
    assert binary_auc(np.array([1, 1]), np.array([0.1, 0.2])) is None


def test_regression_metrics() -> None:
    values = metric_values("regression", ["mae", "rmse"], np.array([1.0, 2.0, 3.0]), np.array([[1.0], [3.0], [1.0]]))
    assert values["mae"] == pytest.approx(1.0) and values["rmse"] == pytest.approx(math.sqrt(5 / 3))


def test_slices_by_value_skip_missing_and_cap_the_values(monkeypatch: pytest.MonkeyPatch) -> None:
    masks, notes = slice_masks({"line": ["a", "b", None, "a"]})
    assert {k: v.tolist() for k, v in masks.items()} == {"line=a": [True, False, False, True],
                                                         "line=b": [False, True, False, False]}
    assert notes == []
    from opml_job_orchestrator.pipelines import evaluation
    monkeypatch.setattr(evaluation, "MAX_SLICE_VALUES", 1)
    masks, notes = slice_masks({"line": ["a", "b", "a"]})
    assert list(masks) == ["line=a"] and "2 values; the 1 most frequent" in notes[0]


def _metrics(overall: float, **slices: tuple[float | None, int]) -> dict:
    out = {OVERALL: {"rows": 100, "accuracy": overall}}
    for key, (value, rows) in slices.items():
        out[key] = {"rows": rows, "accuracy": value}
    return out


def test_no_thresholds_blesses_on_the_candidate_s_metrics_alone() -> None:
    blessed, reasons = judge(_config(thresholds=[]), _metrics(0.1), None, no_baseline_why="first run")
    assert blessed is True
    assert [r.message for r in reasons] == [NO_THRESHOLDS]


def test_value_thresholds_apply_overall_and_per_slice_and_small_slices_are_not_judged() -> None:
    config = _config(thresholds=[{"metric": "accuracy", "lower": 0.8}], min_rows=30)
    candidate = _metrics(0.9, **{"line=a": (0.95, 50), "line=b": (0.7, 40), "line=c": (0.1, 5)})
    blessed, reasons = judge(config, candidate, None, no_baseline_why="first run")
    assert blessed is False
    by_slice = {(r.slice, r.metric): r for r in reasons}
    assert by_slice[(None, "accuracy")].passed is True
    assert by_slice[("line=a", "accuracy")].passed is True
    failed = by_slice[("line=b", "accuracy")]
    assert (failed.passed, failed.value, failed.threshold) == (False, 0.7, {"lower": 0.8})
    small = by_slice[("line=c", None)]
    assert small.passed is None and "5 rows, fewer than min_rows 30" in small.message
    only_overall = _config(thresholds=[{"metric": "accuracy", "lower": 0.8, "slices": False}])
    assert judge(only_overall, candidate, None, no_baseline_why="first run")[0] is True


def test_change_thresholds_follow_tfma_and_are_not_judged_without_a_baseline() -> None:
    not_worse = _config(thresholds=[{"metric": "accuracy", "change": {"direction": "higher_is_better",
                                                                      "absolute": -0.01}}])
    assert judge(not_worse, _metrics(0.895), _metrics(0.9), no_baseline_why=None)[0] is True
    blessed, reasons = judge(not_worse, _metrics(0.88), _metrics(0.9), no_baseline_why=None)
    assert blessed is False
    assert (reasons[0].value, reasons[0].baseline_value, reasons[0].passed) == (0.88, 0.9, False)
    assert "absolute change -0.02 (>= -0.01)" in reasons[0].message
    relative = _config(metrics=["accuracy"], thresholds=[{"metric": "accuracy", "change": {"relative": 0.1}}])
    assert judge(relative, _metrics(0.85), _metrics(0.8), no_baseline_why=None)[0] is False  # +6.25% < +10%
    assert judge(relative, _metrics(0.89), _metrics(0.8), no_baseline_why=None)[0] is True
    blessed, reasons = judge(not_worse, _metrics(0.1), None, no_baseline_why="no baseline: the first run")
    assert blessed is True
    assert reasons[0].passed is None and "not judged: no baseline: the first run" in reasons[0].message


def test_lower_is_better_change() -> None:
    config = _config(metrics=["log_loss"], thresholds=[
        {"metric": "log_loss", "change": {"direction": "lower_is_better", "absolute": 0.0}}])
    worse = {OVERALL: {"rows": 10, "log_loss": 0.5}}
    better = {OVERALL: {"rows": 10, "log_loss": 0.3}}
    assert judge(config, better, worse, no_baseline_why=None)[0] is True
    assert judge(config, worse, better, no_baseline_why=None)[0] is False


def test_an_undefined_metric_on_a_slice_is_reported_not_failed() -> None:
    config = _config(metrics=["auc"], thresholds=[{"metric": "auc", "lower": 0.7}], min_rows=1)
    candidate = {OVERALL: {"rows": 10, "auc": 0.8}, "line=a": {"rows": 3, "auc": None}}
    blessed, reasons = judge(config, candidate, None, no_baseline_why="first run")
    assert blessed is True
    assert any(r.slice == "line=a" and r.passed is None and "not defined" in r.message for r in reasons)


def test_a_long_slice_value_is_named_by_its_start_and_a_hash() -> None:
    long_a, long_b = "x" * 100 + "a", "x" * 100 + "b"
    masks, _ = slice_masks({"note": [long_a, long_b, long_a]})
    keys = sorted(masks)
    assert len(keys) == 2 and all(len(k) == len("note=") + 64 for k in keys) and keys[0] != keys[1]
    assert [m.tolist() for m in (masks[k] for k in keys)] in ([[True, False, True], [False, True, False]],
                                                             [[False, True, False], [True, False, True]])
