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

import math
from collections import defaultdict
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
_EXACT_KS_ROWS = 10_000
"""scipy's ``ks_2samp`` (method "auto") computes the exact p-value while both samples hold at most this
many rows: a function of the two sizes and the statistic's numerator over their least common multiple."""
_KS_PVALUES: dict[tuple[int, int, int], float] = {}
_KS_PVALUES_MAX = 100_000
"""Exact KS p-values by (reference rows, window rows, numerator), at most this many (then emptied)."""


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
        self.reference = values if self.categorical else np.sort(values).astype(np.float64)
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
            return self._result(values, float(jensenshannon(ref / ref.sum() + _EPS, cur / cur.sum() + _EPS)), 0.0)
        wasserstein, ks = _ecdf_gaps(self.reference[None, :], values[None, :].astype(np.float64))
        return self._result(values, float(wasserstein[0]), float(ks[0]))

    def _result(self, values: np.ndarray, distance: float, ks: float) -> FeatureDrift:
        """``values``: the window's usable values; ``distance``: the Jensen-Shannon distance of a
        column of categories, the reference's and the window's Wasserstein-1 distance (unnormed) of a
        continuous one, whose KS statistic is ``ks``."""
        if self.categories is None:
            distance /= self._std
        statistic = self._statistic(values, distance, ks)
        drifted = statistic < self.threshold if self.method in _TESTS else statistic > self.threshold
        return FeatureDrift(self.name, self.method, statistic, self.threshold, bool(drifted), distance)

    def _statistic(self, values: np.ndarray, distance: float, ks: float) -> float:
        method = self.method
        if method == "ks":
            return _ks_pvalue(self.reference, values, ks)
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


def _ecdf_gaps(reference: np.ndarray, window: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``reference`` and ``window`` (a column's values each, NaN for none): the Wasserstein-1
    distance between the two samples and their two-sample KS statistic, as scipy's
    ``wasserstein_distance`` and ``ks_2samp`` compute them (equal to float rounding: scipy sums in
    another order), but for every column in one sort: scipy sorts and searches each pair apart, and
    over a window's 256 columns that was most of its cost. Both read the gap between the two empirical
    CDFs over the merged sorted values; a tie counts where its group ends (the next value differs)."""
    merged = np.concatenate([reference, window], axis=1)
    order = np.argsort(merged, axis=1)  # NaN last; the order within a tie does not matter
    values = np.take_along_axis(merged, order, axis=1)
    valid = ~np.isnan(values)
    from_reference = valid & (order < reference.shape[1])
    ref_cdf = np.cumsum(from_reference, axis=1, dtype=np.int32)
    win_cdf = np.cumsum(valid & ~from_reference, axis=1, dtype=np.int32)
    with np.errstate(invalid="ignore", divide="ignore"):  # a sample without values: NaN, not used
        gap = np.abs(ref_cdf[:, :-1] / ref_cdf[:, -1:] - win_cdf[:, :-1] / win_cdf[:, -1:])
    steps = np.where(valid[:, 1:], np.diff(values, axis=1), 0.0)
    return np.einsum("ij,ij->i", gap, steps), np.max(np.where(steps > 0, gap, 0.0), axis=1, initial=0.0)


def _ks_pvalue(reference: np.ndarray, values: np.ndarray, statistic: float) -> float:
    """``ks_2samp(reference, values).pvalue``. Its exact p-value costs time growing with the statistic
    (about 3 ms a drifted column of a 500-row reference and a 1000-row window), and depends on the two
    sizes and the statistic's numerator only, which take few values between a segment's windows: it is
    computed once for each (the same float)."""
    rows = (len(reference), len(values))
    if max(rows) > _EXACT_KS_ROWS:  # the asymptotic p-value: cheap, and of the statistic itself
        return float(stats.ks_2samp(reference, values).pvalue)
    key = (*rows, round(statistic * (rows[0] // math.gcd(*rows) * rows[1])))
    pvalue = _KS_PVALUES.get(key)
    if pvalue is None:
        if len(_KS_PVALUES) >= _KS_PVALUES_MAX:
            _KS_PVALUES.clear()
        pvalue = _KS_PVALUES[key] = float(stats.ks_2samp(reference, values).pvalue)
    return pvalue


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
        continuous = [name for name, column in self.columns.items() if column.categories is None]
        self._row = {name: row for row, name in enumerate(continuous)}
        longest = max((len(self.columns[name].reference) for name in continuous), default=0)
        self._references = np.full((len(continuous), longest), np.nan)
        """The continuous columns' sorted reference values, one a row, NaN after its last."""
        for name, row in self._row.items():
            self._references[row, :len(self.columns[name].reference)] = self.columns[name].reference

    def measure(self, window: Mapping[str, np.ndarray]) -> dict[str, FeatureDrift]:
        """Drift of every column the window holds (a column it lacks is a data-quality matter); the
        continuous columns of one length measured together (:func:`_ecdf_gaps`)."""
        out: dict[str, FeatureDrift | None] = {}
        together: defaultdict[int, list[str]] = defaultdict(list)
        for name, column in self.columns.items():
            if name not in window:
                continue
            if name in self._row and len(column.reference):
                together[len(window[name])].append(name)
                out[name] = None  # in the columns' order
            else:
                out[name] = column.measure(window[name])
        for names in together.values():
            values = np.array([window[name] for name in names], dtype=np.float64)
            wasserstein, ks = _ecdf_gaps(self._references[[self._row[name] for name in names]], values)
            for i, name in enumerate(names):
                usable = values[i][~np.isnan(values[i])]
                if len(usable):
                    out[name] = self.columns[name]._result(usable, float(wasserstein[i]), float(ks[i]))
        return {name: result for name, result in out.items() if result is not None}
