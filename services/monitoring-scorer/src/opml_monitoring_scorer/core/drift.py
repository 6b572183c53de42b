"""Drift of one column between the reference and a window, with Evidently's default choice of method.

Evidently picks by the reference's size and the column's kind, and we do the same (``method="auto"``):

| reference rows | numeric (> 5 distinct values) | categorical, or numeric with <= 5 values |
|---|---|---|
| <= 1000 | Kolmogorov-Smirnov, drift at p < 0.05 | chi-square (Z-test of proportions for 2 values), p < 0.05 |
| > 1000 | Wasserstein distance / reference std, drift over 0.1 | Jensen-Shannon distance, drift over 0.1 |

A method can be named instead (``ks``, ``wasserstein``, ``psi`` (drift over 0.1), ``chisquare``,
``jensenshannon``, ``ztest``). Whatever decides, every result also carries a *distance*
(normed Wasserstein for numbers, Jensen-Shannon for categories), so rules can say "drift over 0.2"
on the same scale for every feature.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats
from scipy.spatial.distance import jensenshannon

from opml_monitoring_scorer.core.reference import is_categorical

METHODS = ("auto", "ks", "wasserstein", "psi", "chisquare", "jensenshannon", "ztest")
_TESTS = {"ks", "chisquare", "ztest"}
_EPS = 1e-4
UNKNOWN = "__unknown__"
"""The bucket of categories the reference never saw."""


@dataclass(frozen=True)
class FeatureDrift:
    """One column's drift in one window. ``statistic`` is the method's (a p-value for tests, a
    distance otherwise); ``drifted`` is the method's own decision at its threshold."""

    feature: str
    method: str
    statistic: float
    threshold: float
    drifted: bool
    distance: float


class ColumnDrift:
    """A column's reference distribution, fitted once; :meth:`measure` compares a window to it."""

    def __init__(self, name: str, reference: np.ndarray, *, method: str = "auto", threshold: float | None = None,
                 categorical: bool | None = None) -> None:
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, but got {method!r}")
        self.name = name
        values = reference if (categorical or is_categorical(reference)) else reference[~np.isnan(reference)]
        self.categorical = bool(categorical) if categorical is not None else is_categorical(reference)
        distinct = np.unique(values)
        as_categories = self.categorical or len(distinct) <= 5
        if method == "auto":
            if len(values) <= 1000:
                method = ("ztest" if len(distinct) <= 2 else "chisquare") if as_categories else "ks"
            else:
                method = "jensenshannon" if as_categories else "wasserstein"
        self.method = method
        self.threshold = threshold if threshold is not None else (0.05 if method in _TESTS else 0.1)
        self.reference = values
        self.categories = [str(c) if self.categorical else c for c in distinct] if as_categories else None
        if self.categories is not None:
            self._ref_counts = self._counts(values)
        if not self.categorical:
            self._std = max(float(np.std(values)), _EPS) if len(values) else 1.0
            quantiles = np.quantile(values, np.linspace(0, 1, 11)) if len(values) else np.zeros(11)
            self._psi_edges = np.unique(quantiles)

    def _counts(self, values: np.ndarray) -> np.ndarray:
        """Counts per reference category, then one bucket for categories never seen."""
        assert self.categories is not None
        index = {c: i for i, c in enumerate(self.categories)}
        counts = np.zeros(len(self.categories) + 1)
        for value in values:
            counts[index.get(str(value) if self.categorical else value, len(self.categories))] += 1
        return counts

    def measure(self, window: np.ndarray) -> FeatureDrift | None:
        """The window's drift, or None when the window holds no usable value of this column."""
        values = window if self.categorical else window[~np.isnan(window)]
        if len(values) == 0 or len(self.reference) == 0:
            return None
        if self.categories is not None:
            ref = self._ref_counts
            cur = self._counts(values)
            distance = float(jensenshannon(ref / ref.sum() + _EPS, cur / cur.sum() + _EPS))
        else:
            distance = float(stats.wasserstein_distance(self.reference, values) / self._std)
        statistic = self._statistic(values, distance)
        drifted = statistic < self.threshold if self.method in _TESTS else statistic > self.threshold
        return FeatureDrift(self.name, self.method, statistic, self.threshold, bool(drifted), distance)

    def _statistic(self, values: np.ndarray, distance: float) -> float:
        method = self.method
        if method == "ks":
            return float(stats.ks_2samp(self.reference, values).pvalue)
        if method == "wasserstein" and not self.categorical:
            return distance
        if method == "psi" and not self.categorical:
            edges = self._psi_edges
            ref = np.histogram(np.clip(self.reference, edges[0], edges[-1]), edges)[0] / len(self.reference)
            cur = np.histogram(np.clip(values, edges[0], edges[-1]), edges)[0] / len(values)
            ref, cur = np.maximum(ref, _EPS), np.maximum(cur, _EPS)
            return float(np.sum((cur - ref) * np.log(cur / ref)))
        if self.categories is None:  # a categorical method named for a continuous column: use the distance
            return distance
        ref, cur = self._ref_counts, self._counts(values)
        if method == "chisquare":
            keep = (ref > 0) | (cur > 0)
            expected = (ref[keep] + _EPS) / (ref[keep] + _EPS).sum() * cur[keep].sum()
            return float(stats.chisquare(cur[keep], expected).pvalue)
        if method == "ztest":
            return _proportion_z_pvalue(ref, cur)
        return distance  # jensenshannon


def _proportion_z_pvalue(ref: np.ndarray, cur: np.ndarray) -> float:
    """Two-sided Z-test that the first category's share is the same in both samples."""
    n1, n2 = ref.sum(), cur.sum()
    p1, p2 = ref[0] / n1, cur[0] / n2
    pooled = (ref[0] + cur[0]) / (n1 + n2)
    se = np.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    if se == 0:
        return 1.0 if p1 == p2 else 0.0
    return float(2 * stats.norm.sf(abs(p1 - p2) / se))


class DriftSuite:
    """One :class:`ColumnDrift` per feature, plus the model's outputs and confidence as columns."""

    def __init__(self, reference: Mapping[str, np.ndarray], *, methods: Mapping[str, str] | None = None,
                 thresholds: Mapping[str, float] | None = None,
                 categorical: Sequence[str] = ()) -> None:
        methods, thresholds = methods or {}, thresholds or {}
        self.columns = {
            name: ColumnDrift(name, column, method=methods.get(name, methods.get("*", "auto")),
                              threshold=thresholds.get(name, thresholds.get("*")),
                              categorical=True if name in categorical else None)
            for name, column in reference.items()}

    def measure(self, window: Mapping[str, np.ndarray]) -> dict[str, FeatureDrift]:
        """Drift of every column the window holds (a column it lacks is a data-quality matter)."""
        out = {}
        for name, column in self.columns.items():
            if name in window:
                result = column.measure(window[name])
                if result is not None:
                    out[name] = result
        return out
