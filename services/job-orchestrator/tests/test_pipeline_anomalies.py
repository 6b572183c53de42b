"""Anomalies of a span against the schema and the previous span: each check, its threshold, the
distances' values, and the thresholds' validation with every mistake named at once."""

from __future__ import annotations

import math

import numpy as np
import pytest

from opml_job_orchestrator.pipelines import anomalies, schema
from opml_job_orchestrator.pipelines.anomalies import (
    Thresholds,
    ThresholdsError,
    find,
    infinity_norm,
    jensen_shannon_divergence,
    parse_thresholds,
    threshold_errors,
)
from opml_job_orchestrator.pipelines.statistics import compute
from opml_job_orchestrator.pipelines.table import from_rows


def _stats(columns: dict[str, list[str]], schema_doc: dict | None = None) -> dict:
    names = list(columns)
    rows = [[columns[n][i] for n in names] for i in range(len(columns[names[0]]))]
    return compute(from_rows(names, rows), schema_doc)


def _numbers(values: np.ndarray) -> list[str]:
    return [f"{v:.6f}" for v in values]


RNG = np.random.default_rng(7)
BASE = {"x": _numbers(RNG.normal(size=400)), "c": [["a", "b", "c", "d"][i % 4] for i in range(400)]}


def _kinds(found: list[anomalies.Anomaly]) -> dict[tuple[str | None, str], anomalies.Anomaly]:
    return {(a.feature, a.kind): a for a in found}


def test_the_same_distribution_has_no_anomaly() -> None:
    first = _stats(BASE)
    inferred = schema.infer(first, span="1")
    again = _stats({"x": _numbers(np.random.default_rng(8).normal(size=400)), "c": list(BASE["c"])}, inferred)
    assert find(again, inferred, first, Thresholds()) == []


def test_each_check_names_the_feature_statistic_value_and_threshold() -> None:
    first = _stats(BASE)
    inferred = schema.infer(first, span="1")
    n = 300
    drifted = {
        "x": _numbers(np.random.default_rng(9).normal(loc=3.0, size=n)),       # numeric drift
        "c": ["a"] * 250 + ["zzz"] * 50,                                       # categorical drift + unseen
        "new": ["1"] * n,                                                       # not in the schema
    }
    found = _kinds(find(_stats(drifted, inferred), inferred, first, Thresholds()))
    assert set(found) == {("x", "COMPARATOR_JENSEN_SHANNON_DIVERGENCE_HIGH"), ("c", "COMPARATOR_L_INFTY_HIGH"),
                          ("c", "ENUM_TYPE_UNEXPECTED_STRING_VALUES"), ("new", "SCHEMA_NEW_COLUMN")}
    jsd = found[("x", "COMPARATOR_JENSEN_SHANNON_DIVERGENCE_HIGH")]
    assert jsd.statistic == "jensen_shannon_divergence" and jsd.threshold == 0.1 and jsd.value > 0.5
    unseen = found[("c", "ENUM_TYPE_UNEXPECTED_STRING_VALUES")]
    assert (unseen.statistic, unseen.value, unseen.threshold) == ("unseen_share", 50 / 300, 0.01)
    assert "'zzz'" in unseen.message
    linf = found[("c", "COMPARATOR_L_INFTY_HIGH")]
    assert linf.value == pytest.approx(250 / 300 - 0.25)


def test_missing_column_nan_flood_type_change_and_example_count() -> None:
    first = _stats(BASE)
    inferred = schema.infer(first, span="1")
    n = 100
    flood = {"x": ["nan"] * 60 + _numbers(np.zeros(40)), "label": ["1"] * n}
    found = _kinds(find(_stats(flood, inferred), inferred, first, Thresholds(), label="y"))
    missing = found[("c", "SCHEMA_MISSING_COLUMN")]
    assert (missing.statistic, missing.value, missing.threshold) == ("column", "absent", "present")
    assert ("y", "SCHEMA_MISSING_COLUMN") in found, "the label is required even when the schema lacks it"
    nan = found[("x", "FLOAT_TYPE_HAS_NAN")]
    assert (nan.value, nan.threshold) == (0.6, 0.01)
    count = found[(None, "COMPARATOR_LOW_NUM_EXAMPLES")]
    assert (count.statistic, count.value, count.threshold) == ("num_examples_ratio", 0.25, 0.5)
    typed = _kinds(find(_stats({"x": ["a"] * 400, "c": list(BASE["c"])}, inferred), inferred, first, Thresholds()))
    change = typed[("x", "UNEXPECTED_DATA_TYPE")]
    assert (change.value, change.threshold) == ("string", "float")
    assert set(typed) == {("x", "UNEXPECTED_DATA_TYPE")}, "a column of another type is not compared further"


def test_required_column_with_empty_cells() -> None:
    first = _stats(BASE)
    inferred = schema.infer(first, span="1")
    holes = {"x": [""] * 10 + BASE["x"][10:], "c": list(BASE["c"])}
    found = _kinds(find(_stats(holes, inferred), inferred, None, Thresholds()))
    assert found[("x", "FEATURE_TYPE_LOW_FRACTION_PRESENT")].value == 10 / 400
    relaxed = parse_thresholds({"features": {"x": {"missing_share": 0.05}}})
    assert find(_stats(holes, inferred), inferred, None, relaxed) == []


def test_per_feature_thresholds_and_null_turns_a_check_off() -> None:
    first = _stats(BASE)
    inferred = schema.infer(first, span="1")
    shifted = _stats({"x": _numbers(np.random.default_rng(9).normal(loc=3.0, size=400)), "c": list(BASE["c"])},
                     inferred)
    assert find(shifted, inferred, first, parse_thresholds({"features": {"x": {"jensen_shannon_divergence": None}}})) == []
    assert find(shifted, inferred, first, parse_thresholds({"default": {"jensen_shannon_divergence": None}})) == []
    assert len(find(shifted, inferred, first, parse_thresholds({"features": {"c": {"infinity_norm": 0.0}}}))) == 1


def test_jensen_shannon_divergence_is_tfdv_s_base_2_one() -> None:
    hist = {"edges": [0, 1, 2], "counts": [10, 10], "below": 0, "above": 0}
    assert jensen_shannon_divergence(hist, hist) == 0.0
    disjoint = {"edges": [0, 1, 2], "counts": [0, 0], "below": 5, "above": 0}
    assert jensen_shannon_divergence(hist, disjoint) == pytest.approx(1.0)
    p = {"edges": [0, 1, 2], "counts": [1, 0], "below": 0, "above": 0}
    q = {"edges": [0, 1, 2], "counts": [1, 1], "below": 0, "above": 0}
    expected = 0.5 * (1 * math.log2(1 / 0.75)) + 0.5 * (0.5 * math.log2(0.5 / 0.75) + 0.5 * math.log2(0.5 / 0.25))
    assert jensen_shannon_divergence(p, q) == pytest.approx(expected)
    empty = {"edges": [0, 1, 2], "counts": [0, 0], "below": 0, "above": 0}
    assert jensen_shannon_divergence(hist, empty) is None


def test_histograms_on_different_edges_are_rebinned() -> None:
    coarse = {"edges": [0.0, 2.0], "counts": [20], "below": 0, "above": 0}
    fine = {"edges": [0.0, 1.0, 2.0], "counts": [10, 10], "below": 0, "above": 0}
    assert jensen_shannon_divergence(coarse, fine) == pytest.approx(0.0)
    lopsided = {"edges": [0.0, 1.0, 2.0], "counts": [20, 0], "below": 0, "above": 0}
    assert jensen_shannon_divergence(coarse, lopsided) > 0.3


def test_infinity_norm_over_shares_with_an_other_bucket() -> None:
    p = {"top": [["a", 5], ["b", 5]], "other": 0}
    q = {"top": [["a", 2], ["c", 6]], "other": 2}
    assert infinity_norm(p, q) == pytest.approx(0.6)  # c: 0 -> 0.6
    assert infinity_norm(p, p) == 0.0
    assert infinity_norm(p, {"top": [], "other": 0}) is None


def test_threshold_errors_name_every_mistake_with_its_path() -> None:
    errors = threshold_errors({
        "default": {"nan_share": 2, "jsd": 0.1},
        "features": {"age": {"infinity_norm": "high"}, "ok": {"nan_share": None}},
        "num_examples": {"min_fraction": 3, "max_fraction": 1, "most": 1},
        "extra": {},
    }, "pipeline.steps[1].validate.thresholds")
    prefix = "pipeline.steps[1].validate.thresholds"
    expected = [f"{prefix}.extra: is not a setting", f"{prefix}.default.nan_share: must be a number in [0, 1]",
                f"{prefix}.default.jsd: is not a check", f"{prefix}.features.age.infinity_norm: must be a number",
                f"{prefix}.num_examples.most: is not a setting",
                f"{prefix}.num_examples: min_fraction (3) must be <= max_fraction (1)"]
    assert len(errors) == len(expected)
    for error, start in zip(errors, expected, strict=True):
        assert error.startswith(start), (error, start)
    assert threshold_errors(None) == [] and threshold_errors({}) == []
    assert threshold_errors([1])[0].startswith("thresholds: must be a mapping")
    with pytest.raises(ThresholdsError) as caught:
        parse_thresholds({"default": {"nan_share": -1}, "features": {"x": 1}})
    assert len(caught.value.problems) == 2


def test_parsed_thresholds_fall_back_to_the_defaults() -> None:
    parsed = parse_thresholds({"default": {"nan_share": 0.2}, "features": {"x": {"infinity_norm": 0.3}},
                               "num_examples": {"max_fraction": None}})
    assert parsed.of("x", "infinity_norm") == 0.3
    assert parsed.of("x", "nan_share") == 0.2
    assert parsed.of("y", "jensen_shannon_divergence") == 0.1
    assert (parsed.min_fraction, parsed.max_fraction) == (0.5, None)
