"""Anomalies of the newest span: against the schema, and drift against the previous span.

The checks and their names follow TFDV's (``anomalies.md``) so its users read them unchanged:

| kind | statistic | when |
|---|---|---|
| SCHEMA_MISSING_COLUMN | column | a schema column (or the label) is absent from the span |
| SCHEMA_NEW_COLUMN | column | a span column is not in the schema |
| UNEXPECTED_DATA_TYPE | type | the column's values no longer parse as the schema's type |
| FEATURE_TYPE_LOW_FRACTION_PRESENT | missing_share | a required column's empty share > threshold |
| FLOAT_TYPE_HAS_NAN | nan_share | NaN share of the rows > threshold |
| ENUM_TYPE_UNEXPECTED_STRING_VALUES | unseen_share | share of values outside the schema's domain > threshold |
| COMPARATOR_JENSEN_SHANNON_DIVERGENCE_HIGH | jensen_shannon_divergence | numeric drift from the previous span |
| COMPARATOR_L_INFTY_HIGH | infinity_norm | categorical drift from the previous span |
| COMPARATOR_LOW_NUM_EXAMPLES / _HIGH_ | num_examples_ratio | examples / previous span's outside the bounds |

The Jensen-Shannon divergence is TFDV's approximate one: base 2 (0 = same, 1 = disjoint), over the
normalized counts of the histograms on the schema's fixed bins, plus one bucket below the first edge
and one above the last (a shift outside the first span's range is seen, not clipped). Two histograms
on different edges (statistics computed under an older schema) are rebinned onto the union of their
edges, each bin's mass spread evenly over its width. The L-infinity distance is the largest
difference of a value's share between the spans, over the values both keep plus one bucket for the
rest. As in TFDV, L-infinity is not applied to numeric columns (it was silently 0 there) nor
Jensen-Shannon to categorical ones.

Thresholds (the step's ``thresholds``; every key optional, ``null`` turns a check off)::

    default: {missing_share: 0.0, nan_share: 0.01, unseen_share: 0.01,
              jensen_shannon_divergence: 0.1, infinity_norm: 0.1}
    features: {age: {jensen_shannon_divergence: 0.2}, user_id: {infinity_norm: null}}
    num_examples: {min_fraction: 0.5, max_fraction: 2.0}

A check is an anomaly when its value is strictly above its threshold (below, for ``min_fraction``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opml_job_orchestrator.pipelines.schema import conforms

FEATURE_CHECKS = ("missing_share", "nan_share", "unseen_share", "jensen_shannon_divergence", "infinity_norm")
DEFAULT_THRESHOLDS: dict[str, float | None] = {
    "missing_share": 0.0, "nan_share": 0.01, "unseen_share": 0.01,
    "jensen_shannon_divergence": 0.1, "infinity_norm": 0.1,
}
DEFAULT_MIN_FRACTION = 0.5
DEFAULT_MAX_FRACTION = 2.0
MAX_THRESHOLD_FEATURES = 1_000
"""Most features the thresholds may name (a span has at most this many columns)."""
_TOP_KEYS = ("default", "features", "num_examples")
_EXAMPLES_KEYS = ("min_fraction", "max_fraction")


class ThresholdsError(ValueError):
    """Thresholds break the schema; ``problems`` lists every one with its path."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = tuple(problems)


@dataclass(frozen=True)
class Thresholds:
    default: dict[str, float | None] = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))
    features: dict[str, dict[str, float | None]] = field(default_factory=dict)
    min_fraction: float | None = DEFAULT_MIN_FRACTION
    max_fraction: float | None = DEFAULT_MAX_FRACTION

    def of(self, feature: str, check: str) -> float | None:
        """The threshold of ``check`` on ``feature`` (its own, else the default; None: not checked)."""
        own = self.features.get(feature, {})
        return own[check] if check in own else self.default.get(check)


@dataclass(frozen=True)
class Anomaly:
    kind: str
    feature: str | None
    statistic: str
    value: Any
    threshold: Any
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"feature": self.feature, "statistic": self.statistic, "value": self.value,
                "threshold": self.threshold, "kind": self.kind, "message": self.message}


# ----------------------------------------------------------------------------------------------
# Thresholds


def threshold_errors(obj: Any, path: str = "thresholds") -> list[str]:
    """Every rule ``obj`` breaks as a thresholds setting, each prefixed by its path under ``path``
    (an empty list: valid). The pipeline engine calls it when a pipeline spec is submitted."""
    if obj is None:
        return []
    if not isinstance(obj, Mapping):
        return [f"{path}: must be a mapping with {', '.join(_TOP_KEYS)}, but got {_show(obj)}"]
    problems = [f"{path}.{key}: is not a setting; the settings are {', '.join(_TOP_KEYS)}"
                for key in obj if key not in _TOP_KEYS]
    problems += _checks_errors(obj.get("default"), f"{path}.default")
    features = obj.get("features")
    if features is not None:
        if not isinstance(features, Mapping):
            problems.append(f"{path}.features: must be a mapping of column -> thresholds, but got {_show(features)}")
        else:
            if len(features) > MAX_THRESHOLD_FEATURES:
                problems.append(f"{path}.features: at most {MAX_THRESHOLD_FEATURES} columns, but got {len(features)}")
            for name, checks in features.items():
                if not isinstance(name, str) or not name:
                    problems.append(f"{path}.features: column names must be non-empty strings, but got {_show(name)}")
                else:
                    problems += _checks_errors(checks, f"{path}.features.{name}")
    examples = obj.get("num_examples")
    if examples is not None:
        if not isinstance(examples, Mapping):
            problems.append(f"{path}.num_examples: must be a mapping with min_fraction, max_fraction")
        else:
            problems += [f"{path}.num_examples.{key}: is not a setting; the settings are min_fraction, max_fraction"
                         for key in examples if key not in _EXAMPLES_KEYS]
            for key in _EXAMPLES_KEYS:
                value = examples.get(key)
                if value is not None and not (_number(value) and value >= 0):
                    problems.append(f"{path}.num_examples.{key}: must be a number >= 0 or null, but got {_show(value)}")
            low, high = examples.get("min_fraction"), examples.get("max_fraction")
            if _number(low) and _number(high) and low > high:
                problems.append(f"{path}.num_examples: min_fraction ({low}) must be <= max_fraction ({high})")
    return problems


def _checks_errors(checks: Any, path: str) -> list[str]:
    if checks is None:
        return []
    if not isinstance(checks, Mapping):
        return [f"{path}: must be a mapping of check -> threshold, but got {_show(checks)}"]
    problems = []
    for key, value in checks.items():
        if key not in FEATURE_CHECKS:
            problems.append(f"{path}.{key}: is not a check; the checks are {', '.join(FEATURE_CHECKS)}")
        elif value is not None and not (_number(value) and 0 <= value <= 1):
            problems.append(f"{path}.{key}: must be a number in [0, 1] or null (off), but got {_show(value)}")
    return problems


def parse_thresholds(obj: Any, path: str = "thresholds") -> Thresholds:
    """Raises: ThresholdsError listing every problem (see :func:`threshold_errors`)."""
    problems = threshold_errors(obj, path)
    if problems:
        raise ThresholdsError(problems)
    obj = obj or {}
    default = dict(DEFAULT_THRESHOLDS)
    default.update(obj.get("default") or {})
    features = {name: dict(checks or {}) for name, checks in (obj.get("features") or {}).items()}
    examples = obj.get("num_examples") or {}
    return Thresholds(default, features, examples.get("min_fraction", DEFAULT_MIN_FRACTION),
                      examples.get("max_fraction", DEFAULT_MAX_FRACTION))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ----------------------------------------------------------------------------------------------
# Checks


def find(current: Mapping[str, Any], schema: Mapping[str, Any], previous: Mapping[str, Any] | None,
         thresholds: Thresholds, *, label: str | None = None) -> list[Anomaly]:
    """Every anomaly of the ``current`` span's statistics against ``schema`` and, when given, the
    ``previous`` span's statistics (drift and the example count)."""
    found: list[Anomaly] = []
    rows = current["num_examples"]
    if previous is not None:
        found += _num_examples(rows, previous["num_examples"], thresholds)
    columns, expected = current["features"], schema["features"]
    for name in expected:
        if name not in columns:
            found.append(Anomaly("SCHEMA_MISSING_COLUMN", name, "column", "absent", "present",
                                 f"column {name!r} of the schema is not in the span"))
    if label is not None and label not in columns and label not in expected:
        found.append(Anomaly("SCHEMA_MISSING_COLUMN", label, "column", "absent", "present",
                             f"label column {label!r} is not in the span"))
    for name, stats in columns.items():
        rules = expected.get(name)
        if rules is None:
            found.append(Anomaly("SCHEMA_NEW_COLUMN", name, "column", "present", "absent",
                                 f"column {name!r} is not in the schema"))
            continue
        if not conforms(rules["type"], stats["type"]):
            found.append(Anomaly("UNEXPECTED_DATA_TYPE", name, "type", stats["type"], rules["type"],
                                 f"column {name!r} holds {stats['type']} values, the schema says {rules['type']}"))
            continue  # its other statistics are not comparable
        found += _shares(name, stats, rules, rows, thresholds)
        before = (previous or {}).get("features", {}).get(name)
        if before is not None and before.get("type") is not None and conforms(rules["type"], before["type"]):
            found += _drift(name, stats, before, thresholds)
    return found


def _num_examples(rows: int, before: int, thresholds: Thresholds) -> list[Anomaly]:
    if before <= 0:
        return []
    ratio = rows / before
    low, high = thresholds.min_fraction, thresholds.max_fraction
    if low is not None and ratio < low:
        return [Anomaly("COMPARATOR_LOW_NUM_EXAMPLES", None, "num_examples_ratio", ratio, low,
                        f"{rows} examples, {ratio:.3g} of the previous span's {before} (min_fraction {low})")]
    if high is not None and ratio > high:
        return [Anomaly("COMPARATOR_HIGH_NUM_EXAMPLES", None, "num_examples_ratio", ratio, high,
                        f"{rows} examples, {ratio:.3g} times the previous span's {before} (max_fraction {high})")]
    return []


def _shares(name: str, stats: Mapping[str, Any], rules: Mapping[str, Any], rows: int,
            thresholds: Thresholds) -> list[Anomaly]:
    found = []
    missing_share = stats["missing"] / rows if rows else 0.0
    limit = thresholds.of(name, "missing_share")
    if rules.get("required") and limit is not None and missing_share > limit:
        found.append(Anomaly("FEATURE_TYPE_LOW_FRACTION_PRESENT", name, "missing_share", missing_share, limit,
                             f"{stats['missing']} of {rows} rows have no {name!r} ({missing_share:.2%}), "
                             f"a required column (threshold {limit})"))
    limit = thresholds.of(name, "nan_share")
    if limit is not None and stats["nan_share"] > limit:
        found.append(Anomaly("FLOAT_TYPE_HAS_NAN", name, "nan_share", stats["nan_share"], limit,
                             f"{stats['nan']} of {rows} rows of {name!r} are NaN ({stats['nan_share']:.2%}), "
                             f"threshold {limit}"))
    limit = thresholds.of(name, "unseen_share")
    domain = rules.get("domain")
    categorical = stats.get("categorical")
    if domain is not None and categorical is not None and limit is not None:
        known = set(domain)
        unseen_values = [(v, c) for v, c in categorical["top"] if v not in known]
        unseen = sum(c for _, c in unseen_values) + categorical["other"]  # the rest: an upper bound
        total = sum(c for _, c in categorical["top"]) + categorical["other"]
        share = unseen / total if total else 0.0
        if share > limit:
            examples = ", ".join(repr(v[:40]) for v, _ in unseen_values[:5])
            found.append(Anomaly("ENUM_TYPE_UNEXPECTED_STRING_VALUES", name, "unseen_share", share, limit,
                                 f"{share:.2%} of {name!r}'s values are outside its domain (threshold {limit}): "
                                 f"{examples}"))
    return found


def _drift(name: str, stats: Mapping[str, Any], before: Mapping[str, Any], thresholds: Thresholds) -> list[Anomaly]:
    now_hist = (stats.get("numeric") or {}).get("histogram")
    then_hist = (before.get("numeric") or {}).get("histogram")
    limit = thresholds.of(name, "jensen_shannon_divergence")
    if now_hist and then_hist and limit is not None:
        divergence = jensen_shannon_divergence(then_hist, now_hist)
        if divergence is not None and divergence > limit:
            return [Anomaly("COMPARATOR_JENSEN_SHANNON_DIVERGENCE_HIGH", name, "jensen_shannon_divergence",
                            divergence, limit, f"{name!r} drifted from the previous span: Jensen-Shannon divergence "
                            f"{divergence:.4f} > {limit}")]
    now_cat, then_cat = stats.get("categorical"), before.get("categorical")
    limit = thresholds.of(name, "infinity_norm")
    if now_cat and then_cat and limit is not None:
        distance = infinity_norm(then_cat, now_cat)
        if distance is not None and distance > limit:
            return [Anomaly("COMPARATOR_L_INFTY_HIGH", name, "infinity_norm", distance, limit,
                            f"{name!r} drifted from the previous span: L-infinity distance {distance:.4f} > {limit}")]
    return []


# ----------------------------------------------------------------------------------------------
# Distances


def jensen_shannon_divergence(p_hist: Mapping[str, Any], q_hist: Mapping[str, Any]) -> float | None:
    """TFDV's approximate JS divergence (base 2, in [0, 1]) of two histograms (None: one is empty)."""
    if list(p_hist["edges"]) == list(q_hist["edges"]):
        p, q = _buckets(p_hist), _buckets(q_hist)
    else:
        edges = sorted(set(p_hist["edges"]) | set(q_hist["edges"]))
        p, q = _rebinned(p_hist, edges), _rebinned(q_hist, edges)
    p_total, q_total = sum(p), sum(q)
    if p_total <= 0 or q_total <= 0:
        return None
    divergence = 0.0
    for a, b in zip(p, q, strict=True):
        a, b = a / p_total, b / q_total
        middle = (a + b) / 2
        if a > 0:
            divergence += 0.5 * a * math.log2(a / middle)
        if b > 0:
            divergence += 0.5 * b * math.log2(b / middle)
    return min(1.0, max(0.0, divergence))


def _buckets(hist: Mapping[str, Any]) -> list[float]:
    return [float(hist["below"]), *map(float, hist["counts"]), float(hist["above"])]


def _rebinned(hist: Mapping[str, Any], edges: Sequence[float]) -> list[float]:
    """``hist``'s counts on ``edges`` (a superset of its own), each bin spread evenly over its width;
    its below/above buckets stay below/above (their spread is unknown)."""
    out = [float(hist["below"])] + [0.0] * (len(edges) - 1) + [float(hist["above"])]
    own = hist["edges"]
    for index, count in enumerate(hist["counts"]):
        low, high = own[index], own[index + 1]
        for slot in range(len(edges) - 1):
            overlap = min(high, edges[slot + 1]) - max(low, edges[slot])
            if overlap > 0:
                out[slot + 1] += count * overlap / (high - low)
    return out


def infinity_norm(p_cat: Mapping[str, Any], q_cat: Mapping[str, Any]) -> float | None:
    """Largest difference of one value's share between two categorical statistics (the values neither
    keeps are one "other" bucket); None when one side has no value."""
    p, q = dict(p_cat["top"]), dict(q_cat["top"])
    p_total = sum(p.values()) + p_cat["other"]
    q_total = sum(q.values()) + q_cat["other"]
    if p_total <= 0 or q_total <= 0:
        return None
    distance = abs(p_cat["other"] / p_total - q_cat["other"] / q_total)
    for value in p.keys() | q.keys():
        distance = max(distance, abs(p.get(value, 0) / p_total - q.get(value, 0) / q_total))
    return distance
