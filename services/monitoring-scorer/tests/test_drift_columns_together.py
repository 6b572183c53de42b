"""A window's continuous columns measured together: the same results as scipy's tests column by
column, and the work a window of drifted columns costs (pure logic)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from opml_monitoring_scorer.core import drift as drift_module
from opml_monitoring_scorer.core.drift import ColumnDrift, DriftSuite

rng = np.random.default_rng(7)


def columns(rows: int, count: int, shift: float) -> dict[str, np.ndarray]:
    """Rounded (ties within and across samples) with some NaN, as span CSVs of pixel columns hold."""
    out = {}
    for i in range(count):
        values = np.round(rng.normal(shift * (i % 3), 1.0 + 0.1 * (i % 4), rows), 2)
        values[rng.random(rows) < 0.02 * (i % 2)] = np.nan
        out[f"f{i}"] = values
    return out


@pytest.mark.parametrize(("reference_rows", "method"), [(500, "ks"), (1500, "wasserstein")])
@pytest.mark.parametrize("shift", [0.0, 0.3])
def test_columns_together_match_scipy_column_by_column(reference_rows, method, shift) -> None:
    reference = columns(reference_rows, 24, 0.0)
    window = columns(1000, 24, shift)
    window["f5"] = window["f5"][:900]  # a column of another length is measured in its own group
    window["f7"][:] = np.nan  # no usable value: not measured
    measured = DriftSuite(reference).measure(window)
    assert set(measured) == set(reference) - {"f7"}
    for name, result in measured.items():
        ref, win = reference[name][~np.isnan(reference[name])], window[name][~np.isnan(window[name])]
        assert result.method == method
        std = max(float(np.std(ref)), 1e-4)
        assert result.distance == pytest.approx(stats.wasserstein_distance(ref, win) / std, rel=1e-12)
        expected = stats.ks_2samp(ref, win).pvalue if method == "ks" else result.distance
        assert result.statistic == expected  # the same float: the KS p-value is scipy's own
        assert result == ColumnDrift(name, reference[name]).measure(window[name])
    if shift:
        assert sum(d.drifted for d in measured.values()) >= 8


def test_a_drifted_windows_exact_ks_p_values_are_computed_once_for_each_statistic(monkeypatch) -> None:
    """The exact KS p-value costs time growing with the statistic (milliseconds for a drifted column);
    it was computed for each of a window's 256 drifted columns, in each window, and a segment of the
    story's dimmed line fell minutes behind its traffic. Wasserstein distances are not computed column
    by column either."""
    calls = {"ks_2samp": 0, "wasserstein_distance": 0}
    for name in calls:
        real = getattr(stats, name)

        def counted(*args, _real=real, _name=name, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(stats, name, counted)
    monkeypatch.setattr(drift_module, "_KS_PVALUES", {})
    suite = DriftSuite({f"f{i}": np.round(rng.normal(size=500), 3) for i in range(256)})
    first = {f"f{i}": np.round(rng.normal(1.0, 1.0, 1000), 3) for i in range(256)}
    measured = suite.measure(first)
    assert all(d.drifted for d in measured.values())
    numerators = set()  # the KS statistic's over the sizes' least common multiple (1000), a column's
    for name, values in first.items():
        ref = np.sort(suite.columns[name].reference)
        grid = np.concatenate([ref, values])
        gap = np.searchsorted(ref, grid, "right") / 500 - np.searchsorted(np.sort(values), grid, "right") / 1000
        numerators.add(round(np.abs(gap).max() * 1000))
    assert calls["ks_2samp"] == len(numerators) < 256
    assert calls["wasserstein_distance"] == 0
    second = {name: values[::-1].copy() for name, values in first.items()}  # the same statistics
    assert suite.measure(second) == measured
    assert calls["ks_2samp"] == len(numerators)
