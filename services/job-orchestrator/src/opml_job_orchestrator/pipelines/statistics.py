"""Statistics of one span (``statistics.json``), computed once per span and compared across spans.

Per column: its type, how many rows hold a value (``count``), are empty (``missing``) or NaN
(``nan``, with ``nan_share`` of all rows); numeric columns add min/max/mean/std over the finite
values, quantiles, and a histogram on fixed bin edges (the schema's, so that any two spans'
histograms compare bin for bin; a span computed without a schema uses its own deciles, which is
what a schema inferred from it takes); categorical columns (strings, bools) add the frequencies of
their :data:`MAX_TOP_VALUES` most frequent values (within :data:`MAX_TOP_CHARS`) and the count of all
the others.

The document is plain JSON, versioned by ``format``; :func:`check` validates one read back.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from opml_job_orchestrator.pipelines.table import NUMERIC_TYPES, TYPES, Column, Table

FORMAT = 1
"""Version of the statistics document."""
MAX_TOP_VALUES = 1_000
"""Most values whose frequency a categorical column keeps (the rest are counted in ``other``)."""
MAX_TOP_CHARS = 32 * 1024
"""Most characters of the values a categorical column keeps (long texts go to ``other``), so a span of
:data:`~opml_job_orchestrator.pipelines.table.MAX_COLUMNS` columns has statistics that are read back
within the step's limit."""
DISCRETE_VALUES = 20
"""A numeric column with at most this many distinct values keeps their frequencies too (``top``), so
a schema inferred from it bins each value alone instead of merging them in deciles."""
QUANTILES = (0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
"""Quantile levels kept for numeric columns (the deciles among them give a schema's bin edges)."""
DECILES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class StatisticsError(ValueError):
    """A statistics document read back breaks the format."""


def compute(table: Table, schema: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The statistics of ``table``; numeric histograms on ``schema``'s bin edges where it has them.

    ``schema`` also decides whether a column is counted as categorical: a column the schema types as
    a string is, even when this span's values all happen to be digits (zip codes).
    """
    features: dict[str, Any] = {}
    schema_features = (schema or {}).get("features", {})
    for name, column in table.columns.items():
        expected = schema_features.get(name, {})
        features[name] = column_statistics(column, table.rows, expected.get("type"), expected.get("bins"))
    return {"format": FORMAT, "num_examples": table.rows, "features": features}


def text_columns(schema: Mapping[str, Any] | None) -> set[str]:
    """The columns whose text a span must be read with (``keep_text``) for :func:`compute` under
    ``schema``: those it types as strings or bools, whatever a span's values look like (zip codes)."""
    return {name for name, rules in (schema or {}).get("features", {}).items()
            if rules.get("type") in ("string", "bool")}


def column_statistics(column: Column, rows: int, schema_type: str | None = None,
                      bins: Sequence[float] | None = None) -> dict[str, Any]:
    missing = int(column.missing.sum())
    stats: dict[str, Any] = {"type": column.type, "count": rows - missing, "missing": missing, "nan": 0,
                             "nan_share": 0.0}
    categorical = column.type in ("string", "bool") or schema_type in ("string", "bool")
    if categorical and column.text is not None:
        stats["categorical"] = _categorical([v for v in column.text if v is not None])
    elif categorical and column.type == "bool":
        assert column.numbers is not None
        values = column.numbers[~column.missing]
        stats["categorical"] = _categorical(["true"] * int((values == 1.0).sum()) + ["false"] * int((values == 0.0).sum()))
    elif categorical:
        raise ValueError(f"column {column.name!r} is categorical in the schema: read the span with "
                         "keep_text=text_columns(schema)")
    elif column.numbers is not None:
        values = column.numbers[~column.missing]
        nan = int(np.isnan(values).sum())
        stats["nan"] = nan
        stats["nan_share"] = nan / rows if rows else 0.0
        stats["numeric"] = _numeric(values[~np.isnan(values)], bins)
    return stats


def _categorical(values: list[str]) -> dict[str, Any]:
    counts = Counter(values)
    top, chars = [], 0
    for value, count in counts.most_common(MAX_TOP_VALUES):
        chars += len(value)
        if chars > MAX_TOP_CHARS:
            break
        top.append((value, count))
    kept = sum(count for _, count in top)
    return {"unique": len(counts), "top": [[value, count] for value, count in top], "other": len(values) - kept}


def _numeric(values: np.ndarray, bins: Sequence[float] | None) -> dict[str, Any]:
    finite = values[np.isfinite(values)]
    out: dict[str, Any] = {"infinite": int(len(values) - len(finite))}
    if len(finite):
        out.update(min=float(finite.min()), max=float(finite.max()), mean=float(finite.mean()),
                   std=float(finite.std()),
                   quantiles=[[q, float(v)] for q, v in zip(QUANTILES, np.quantile(finite, QUANTILES), strict=True)])
        distinct, counts = np.unique(finite, return_counts=True)
        out["unique"] = int(len(distinct))
        if len(distinct) <= DISCRETE_VALUES:
            out["top"] = [[float(v), int(c)] for v, c in zip(distinct, counts, strict=True)]
    else:
        out.update(min=None, max=None, mean=None, std=None, quantiles=[], unique=0)
    edges = list(bins) if bins else default_edges(out)
    out["histogram"] = histogram(values, edges) if edges else None
    return out


def default_edges(numeric: Mapping[str, Any]) -> list[float]:
    """Bin edges for a numeric column of these statistics: between its distinct values when it has
    few (each value its own bin), else its deciles (equal-mass bins, deduplicated); [] with no value."""
    top = numeric.get("top")
    if top:
        points = [float(v) for v, _ in top]
        if len(points) == 1:
            return [points[0] - 0.5, points[0] + 0.5]
        middles = [(a + b) / 2 for a, b in zip(points, points[1:], strict=False)]
        return [points[0] - (middles[0] - points[0])] + middles + [points[-1] + (points[-1] - middles[-1])]
    levels = dict((q, v) for q, v in numeric.get("quantiles", []))
    edges = sorted({float(levels[q]) for q in DECILES if q in levels})
    if len(edges) == 1:
        return [edges[0] - 0.5, edges[0] + 0.5]
    return edges


def histogram(values: np.ndarray, edges: Sequence[float]) -> dict[str, Any]:
    """Counts of the non-NaN ``values`` in the bins ``[edges[i], edges[i+1])`` (the last closed), and
    of those below the first edge and above the last (infinities included)."""
    edges_array = np.asarray(edges, dtype=np.float64)
    values = values[~np.isnan(values)]
    below = int((values < edges_array[0]).sum())
    above = int((values > edges_array[-1]).sum())
    inside = values[(values >= edges_array[0]) & (values <= edges_array[-1])]
    counts, _ = np.histogram(inside, bins=edges_array)
    return {"edges": [float(e) for e in edges_array], "counts": [int(c) for c in counts],
            "below": below, "above": above}


def check(document: Any, what: str) -> dict[str, Any]:
    """``document`` if it is a statistics document of this format.

    Raises:
        StatisticsError: naming ``what`` and every field that is wrong.
    """
    problems: list[str] = []
    if not isinstance(document, dict):
        raise StatisticsError(f"{what}: must be a JSON object, but got {type(document).__name__}")
    if document.get("format") != FORMAT:
        problems.append(f"format must be {FORMAT}, but got {document.get('format')!r}")
    if not _count(document.get("num_examples")):
        problems.append(f"num_examples must be a count, but got {document.get('num_examples')!r}")
    features = document.get("features")
    if not isinstance(features, dict):
        problems.append("features must be an object")
        features = {}
    for name, stats in features.items():
        where = f"features.{name}"
        if not isinstance(stats, dict):
            problems.append(f"{where} must be an object")
            continue
        if stats.get("type") is not None and stats.get("type") not in TYPES:
            problems.append(f"{where}.type must be one of {', '.join(TYPES)} or null, but got {stats.get('type')!r}")
        for key in ("count", "missing", "nan"):
            if not _count(stats.get(key)):
                problems.append(f"{where}.{key} must be a count, but got {stats.get(key)!r}")
        share = stats.get("nan_share")
        if not (_number(share) and 0 <= share <= 1):
            problems.append(f"{where}.nan_share must be a number in [0, 1], but got {share!r}")
        problems += _check_parts(stats, where)
    if problems:
        raise StatisticsError(f"{what}: " + "; ".join(problems[:20]) + (" ..." if len(problems) > 20 else ""))
    return document


def _check_parts(stats: Mapping[str, Any], where: str) -> list[str]:
    problems = []
    categorical = stats.get("categorical")
    if categorical is not None:
        top = categorical.get("top") if isinstance(categorical, dict) else None
        if not (isinstance(top, list) and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                              and _count(p[1]) for p in top)
                and _count(categorical.get("other")) and _count(categorical.get("unique"))):
            problems.append(f"{where}.categorical must hold unique: count, top: [[value, count], ...] and "
                            "other: count")
    numeric = stats.get("numeric")
    if numeric is not None:
        if not isinstance(numeric, dict):
            return [*problems, f"{where}.numeric must be an object"]
        hist = numeric.get("histogram")
        if hist is not None and not _histogram_ok(hist):
            problems.append(f"{where}.numeric.histogram must hold increasing edges, one count per bin, below "
                            "and above")
        if not all(numeric.get(key) is None or _number(numeric[key]) for key in ("min", "max", "mean", "std")):
            problems.append(f"{where}.numeric: min, max, mean and std must be numbers or null")
        for key in ("quantiles", "top"):
            pairs = numeric.get(key, [])
            if not (isinstance(pairs, list) and all(isinstance(p, list) and len(p) == 2 and all(map(_number, p))
                                                    for p in pairs)):
                problems.append(f"{where}.numeric.{key} must be a list of [number, number] pairs")
    if stats.get("type") in NUMERIC_TYPES and categorical is None and numeric is None and stats.get("count"):
        problems.append(f"{where}: a numeric column with values needs numeric statistics")
    return problems


def _histogram_ok(hist: Any) -> bool:
    if not isinstance(hist, dict):
        return False
    edges, counts = hist.get("edges"), hist.get("counts")
    if not (isinstance(edges, list) and isinstance(counts, list) and len(edges) >= 2
            and len(counts) == len(edges) - 1):
        return False
    if not all(isinstance(e, (int, float)) and math.isfinite(e) for e in edges):
        return False
    return (all(a < b for a, b in zip(edges, edges[1:], strict=False)) and all(_count(c) for c in counts)
            and _count(hist.get("below")) and _count(hist.get("above")))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
