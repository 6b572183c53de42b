"""Data quality of a window against the reference: missing features, NaN, out of range, unknown category.

Each check gives a share of the window's rows (0..1) per feature; the window's data-quality share is
the share of rows with at least one problem, which rules compare with "data quality over Z".
Predictions logged as summaries only (tensors above the router's record cap) carry no rows: they
are counted apart (``summary_only``) and flagged, never silently scored as clean.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from opml_monitoring_scorer.core.reference import is_categorical


@dataclass(frozen=True)
class DataQuality:
    rows: int
    missing: dict[str, float] = field(default_factory=dict)
    nan: dict[str, float] = field(default_factory=dict)
    out_of_range: dict[str, float] = field(default_factory=dict)
    unknown_category: dict[str, float] = field(default_factory=dict)
    bad_rows_share: float = 0.0
    summary_only: int = 0

    def flags(self) -> list[str]:
        """Human-readable problems, e.g. ``missing:age``, ``out_of_range:income``, ``summary_only``."""
        found = [f"{kind}:{name}" for kind, shares in (("missing", self.missing), ("nan", self.nan),
                                                        ("out_of_range", self.out_of_range),
                                                        ("unknown_category", self.unknown_category))
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

    def check(self, window: Mapping[str, np.ndarray], rows: int, *, summary_only: int = 0) -> DataQuality:
        """Shares of ``rows`` per problem; a feature absent from the window is missing on every row."""
        if rows == 0:
            return DataQuality(rows=0, summary_only=summary_only)
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
        return DataQuality(rows=rows, missing=missing, nan=nan, out_of_range=out_of_range,
                           unknown_category=unknown, bad_rows_share=float(bad.mean()), summary_only=summary_only)
