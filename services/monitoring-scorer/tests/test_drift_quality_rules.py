"""Drift methods, data quality, monitoring config and alert rules (pure logic)."""

from __future__ import annotations

import numpy as np
import pytest

from opml_common.errors import InvalidArgument
from opml_monitoring_scorer.core.config import MonitoringConfig, WindowSpec
from opml_monitoring_scorer.core.drift import ColumnDrift
from opml_monitoring_scorer.core.quality import QualityChecker
from opml_monitoring_scorer.core.rules import Observation, RuleState, observe, parse_rules, step

rng = np.random.default_rng(0)


def cats(n: int, p) -> np.ndarray:
    return rng.choice(np.array(["a", "b", "c"], dtype=object), size=n, p=p)


@pytest.mark.parametrize(("reference", "method"), [
    (rng.normal(size=800), "ks"),
    (rng.normal(size=5000), "wasserstein"),
    (cats(800, None), "chisquare"),
    (cats(5000, None), "jensenshannon"),
    (rng.integers(0, 2, 800).astype(float), "ztest"),
    (rng.integers(0, 4, 5000).astype(float), "jensenshannon"),
])
def test_auto_picks_evidentlys_default_by_size_and_kind(reference, method) -> None:
    assert ColumnDrift("f", reference).method == method


@pytest.mark.parametrize("method", ["ks", "wasserstein", "psi"])
def test_numeric_methods_see_a_shift_and_pass_a_clean_sample(method) -> None:
    drift = ColumnDrift("f", rng.normal(size=3000), method=method)
    assert not drift.measure(rng.normal(size=1000)).drifted
    shifted = drift.measure(rng.normal(0.8, 1, size=1000))
    assert shifted.drifted and shifted.distance > 0.5


@pytest.mark.parametrize("method", ["chisquare", "jensenshannon"])
def test_categorical_methods_see_a_shift_and_unknown_categories(method) -> None:
    drift = ColumnDrift("f", cats(3000, (0.5, 0.3, 0.2)), method=method)
    assert not drift.measure(cats(1000, (0.5, 0.3, 0.2))).drifted
    assert drift.measure(cats(1000, (0.2, 0.3, 0.5))).drifted
    novel = np.array(["a"] * 500 + ["zzz"] * 500, dtype=object)
    assert drift.measure(novel).drifted


def test_nan_is_ignored_by_drift_and_counted_by_quality() -> None:
    reference = {"x": rng.normal(size=1000), "c": cats(1000, None)}
    window = {"x": np.concatenate([rng.normal(size=90), [np.nan] * 5, [100.0] * 5]),
              "c": np.array(["a"] * 95 + ["new"] * 5, dtype=object)}
    quality = QualityChecker(reference).check(window, 100)
    assert (quality.nan["x"], quality.out_of_range["x"], quality.unknown_category["c"]) == (0.05, 0.05, 0.05)
    assert quality.bad_rows_share == pytest.approx(0.10)  # rows 95-99 are out of range and unknown at once
    assert ColumnDrift("x", reference["x"]).measure(window["x"]) is not None
    missing = QualityChecker(reference).check({"x": window["x"]}, 100)
    assert missing.missing == {"c": 1.0} and missing.bad_rows_share == 1.0 and "missing:c" in missing.flags()


def test_config_reports_every_wrong_field_at_once() -> None:
    text = """
task: tri
window: {count: 3, seconds: -1, size: 5}
features: {input0: []}
drift: {method: magic, thresholds: {age: -1}}
rules:
  - {name: a, signal: score, under: 0.5, for: 0}
  - {name: a, signal: nope, over: x}
  - {name: d, signal: drift, under: 0.1, features: [age]}
surprise: 1
"""
    with pytest.raises(InvalidArgument) as caught:
        MonitoringConfig.parse(text)
    fields = [field for field, _ in caught.value.violations]
    assert fields == ["surprise", "task", "features.input0", "window.size", "window.count", "window.seconds",
                      "drift.method", "drift.thresholds.age", "rules[0].for", "rules[1].name", "rules[1].signal",
                      "rules[1].over", "rules[2].under"]


@pytest.mark.parametrize("drift", ["{methods: [psi]}", "{methods: psi}", "{thresholds: [0.2]}"])
def test_config_names_drift_settings_that_are_not_mappings(drift: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        MonitoringConfig.parse(f"drift: {drift}\nwindow: {{count: 3}}\n")
    field = "drift.methods" if "methods" in drift else "drift.thresholds"
    assert [f for f, _ in caught.value.violations] == ["window.count", field], "every wrong field at once"
    assert "must map feature names (or *) to values" in str(caught.value)


def test_config_syntax_errors_name_line_and_column() -> None:
    with pytest.raises(InvalidArgument, match=r"^monitoring.yaml: is not valid YAML: .* at line 3, column 1"):
        MonitoringConfig.parse("window:\n  count: [1, 2\n")


def test_config_defaults() -> None:
    config = MonitoringConfig.parse("")
    assert config.window == WindowSpec(count=1000, seconds=None) and config.rules == ()


def run(rule_yaml: list[dict], values: list[float]) -> list[tuple[int, bool]]:
    (rule,) = parse_rules(rule_yaml)
    state = RuleState()
    changes = []
    for index, value in enumerate(values):
        change = step(rule, state, observe(rule, {"score": value}, {}), index)
        if change:
            changes.append((index, change.raised))
    return changes


def test_a_rule_raises_after_n_windows_and_resolves_with_hysteresis() -> None:
    rule = [{"name": "low", "signal": "score", "under": 0.8, "for": 2, "clear_after": 2, "margin": 0.05}]
    # one low window does not raise; two do; values inside the band (0.8-0.85) never resolve it
    assert run(rule, [0.9, 0.7, 0.9, 0.7, 0.7, 0.82, 0.9, 0.83, 0.9, 0.9, 0.9]) == [(4, True), (9, False)]


def test_a_noisy_signal_around_the_bound_does_not_flap() -> None:
    rule = [{"name": "low", "signal": "score", "under": 0.8, "for": 3, "margin": 0.05}]
    noisy = [0.79, 0.81, 0.79, 0.81] * 10
    assert run(rule, noisy) == []


def test_drift_rule_on_named_features_with_evidence() -> None:
    (any_feature, named, decided) = parse_rules([
        {"name": "any", "signal": "drift", "over": 0.2},
        {"name": "named", "signal": "drift", "over": 0.2, "features": ["b"]},
        {"name": "decided", "signal": "drift"}])
    drift = {"a": (0.5, True), "b": (0.1, False)}
    assert observe(any_feature, {}, drift) == Observation(0.5, True, False, {"a": 0.5})
    assert not observe(named, {}, drift).breached
    assert observe(decided, {}, drift).evidence == {"a": 0.5}


def test_a_missing_signal_neither_raises_nor_resolves() -> None:
    (rule,) = parse_rules([{"name": "truth", "signal": "true", "under": 0.9}])
    state = RuleState(firing=True, raised_at_window=3)
    assert step(rule, state, observe(rule, {"true": None}, {}), 4) is None and state.firing
