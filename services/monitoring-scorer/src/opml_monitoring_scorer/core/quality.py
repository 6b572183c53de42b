"""Data quality of a window against the reference: missing features, NaN, out of range, unknown category.

Each check gives a share of the window's rows (0..1) per feature; the window's data-quality share is
the share of rows with at least one problem, which rules compare with "data quality over Z".
Predictions logged as summaries only (tensors above the router's record cap) carry no rows: they
are counted apart and flagged (``summary_only``), and checked on what they carry: per reference
input tensor, missing (or without statistics), NaN, or outside the reference's range (its summary's
min or max past the reference values of the tensor). A summary-only prediction with a problem counts
as that many bad rows as it has, so the window's share is of rows either way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from opml_monitoring_scorer.core.reference import is_categorical
from opml_monitoring_scorer.core.summary import PredictionSummary


@dataclass(frozen=True)
class DataQuality:
    rows: int
    missing: dict[str, float] = field(default_factory=dict)
    nan: dict[str, float] = field(default_factory=dict)
    out_of_range: dict[str, float] = field(default_factory=dict)
    unknown_category: dict[str, float] = field(default_factory=dict)
    bad_rows_share: float = 0.0
    summary_only: int = 0
    summary_missing: dict[str, float] = field(default_factory=dict)
    summary_nan: dict[str, float] = field(default_factory=dict)
    summary_out_of_range: dict[str, float] = field(default_factory=dict)
    """Shares of the summary-only predictions, per reference input tensor."""

    def flags(self) -> list[str]:
        """Human-readable problems, e.g. ``missing:age``, ``out_of_range:income``, ``summary_only``,
        ``summary_out_of_range:image``."""
        found = [f"{kind}:{name}" for kind, shares in (("missing", self.missing), ("nan", self.nan),
                                                        ("out_of_range", self.out_of_range),
                                                        ("unknown_category", self.unknown_category),
                                                        ("summary_missing", self.summary_missing),
                                                        ("summary_nan", self.summary_nan),
                                                        ("summary_out_of_range", self.summary_out_of_range))
                 for name, share in shares.items() if share > 0]
        if self.summary_only:
            found.append("summary_only")
        return found


class QualityChecker:
    """Reference ranges (numeric) and category sets (categorical), fitted once."""

    def __init__(self, reference: Mapping[str, np.ndarray]) -> None:
        self.ranges: dict[str, tuple[float, float]] = {}
        self.categories: dict[str, set[str]] = {}
        for name, column in reference.items():
            if is_categorical(column):
                self.categories[name] = {str(v) for v in column}
            else:
                finite = column[np.isfinite(column)]
                if len(finite):
                    self.ranges[name] = (float(finite.min()), float(finite.max()))

    def check(self, window: Mapping[str, np.ndarray], rows: int, *, summary_only: int = 0,
              summaries: Sequence[PredictionSummary] = (),
              tensors: Mapping[str, tuple[float, float]] | None = None) -> DataQuality:
        """Shares of ``rows`` per problem; a feature absent from the window is missing on every row.
        ``summaries``: what the summary-only predictions carry, checked against ``tensors`` (the
        reference's input tensors and their value ranges)."""
        checked = _check_summaries(summaries, tensors or {})
        bad_summary_rows, summary_rows = checked[3], sum(s.rows for s in summaries)
        summary_parts = {"summary_missing": checked[0], "summary_nan": checked[1], "summary_out_of_range": checked[2]}
        if rows == 0:
            share = bad_summary_rows / summary_rows if summary_rows else 0.0
            return DataQuality(rows=0, summary_only=summary_only, bad_rows_share=share, **summary_parts)
        bad = np.zeros(rows, dtype=bool)
        missing, nan, out_of_range, unknown = {}, {}, {}, {}
        for name in list(self.ranges) + list(self.categories):
            column = window.get(name)
            if column is None or len(column) != rows:
                missing[name] = 1.0
                bad[:] = True
                continue
            if name in self.categories:
                known = self.categories[name]
                flag = np.fromiter((str(v) not in known for v in column), dtype=bool, count=rows)
                unknown[name] = float(flag.mean())
            else:
                isnan = np.isnan(column)
                low, high = self.ranges[name]
                outside = ~isnan & ((column < low) | (column > high))
                nan[name] = float(isnan.mean())
                out_of_range[name] = float(outside.mean())
                flag = isnan | outside
            bad |= flag
        share = (float(bad.sum()) + bad_summary_rows) / (rows + summary_rows)
        return DataQuality(rows=rows, missing=missing, nan=nan, out_of_range=out_of_range,
                           unknown_category=unknown, bad_rows_share=share, summary_only=summary_only,
                           **summary_parts)


def _check_summaries(summaries: Sequence[PredictionSummary], tensors: Mapping[str, tuple[float, float]],
                     ) -> tuple[dict[str, float], dict[str, float], dict[str, float], int]:
    """Per tensor, the shares of ``summaries`` missing it, with a NaN statistic, or past its range; and
    the rows of the summaries with any problem."""
    if not summaries or not tensors:
        return {}, {}, {}, 0
    missing = dict.fromkeys(tensors, 0)
    nan = dict.fromkeys(tensors, 0)
    outside = dict.fromkeys(tensors, 0)
    bad_rows = 0
    for summary in summaries:
        bad = False
        for name, (low, high) in tensors.items():
            stats = summary.tensors.get(name)
            if stats is None:
                missing[name] += 1
                bad = True
            elif any(np.isnan(v) for v in (stats.mean, stats.std, stats.min, stats.max)):
                nan[name] += 1
                bad = True
            elif stats.min < low or stats.max > high:
                outside[name] += 1
                bad = True
        bad_rows += summary.rows if bad else 0
    n = len(summaries)
    return ({k: v / n for k, v in missing.items()}, {k: v / n for k, v in nan.items()},
            {k: v / n for k, v in outside.items()}, bad_rows)
