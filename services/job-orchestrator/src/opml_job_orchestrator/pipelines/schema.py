"""The data schema of a pipeline (``schema.json``): what every span is checked against.

Inferred once from the statistics of the first span (as TFDV's ``infer_schema`` does) and then kept
as a versioned bundle by the pipeline engine, so a person can review and edit it. Per column:

- ``type``: bool, int, float or string (a float column whose span holds only whole numbers still
  conforms; an int column with a fraction does not);
- ``required``: the column had a value in every row of the first span;
- ``domain``: the values of a string column with at most :data:`MAX_DOMAIN_VALUES` distinct values
  that repeat (at most :data:`MAX_DOMAIN_UNIQUE_SHARE` of its rows distinct: not an identifier);
- ``range``: the first span's min and max of a numeric column;
- ``bins``: the fixed histogram edges of a numeric column, so every span's histogram compares bin
  for bin (deciles of the first span, or one bin per value for a column with few values).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from opml_job_orchestrator.pipelines.statistics import default_edges
from opml_job_orchestrator.pipelines.table import NUMERIC_TYPES, TYPES

FORMAT = 1
MAX_DOMAIN_VALUES = 100
"""Most distinct values a string column may have for its values to become a domain."""
MAX_DOMAIN_UNIQUE_SHARE = 0.5
"""Highest share of distinct values among a string column's values for a domain (above: an id)."""
MAX_BINS = 1_000
"""Most histogram bins a schema may give a column."""
_KEYS = {"type", "required", "domain", "range", "bins"}


class SchemaError(ValueError):
    """A schema breaks the format; the message names every wrong field."""


def infer(statistics: Mapping[str, Any], *, span: str) -> dict[str, Any]:
    """The schema of a span's statistics (``span`` is recorded as its origin)."""
    features: dict[str, Any] = {}
    rows = statistics["num_examples"]
    for name, stats in statistics["features"].items():
        feature: dict[str, Any] = {"type": stats["type"] or "string", "required": rows > 0 and stats["missing"] == 0}
        categorical, numeric = stats.get("categorical"), stats.get("numeric")
        if stats["type"] == "string" and categorical and categorical["other"] == 0:
            unique = categorical["unique"]
            if 0 < unique <= MAX_DOMAIN_VALUES and unique <= MAX_DOMAIN_UNIQUE_SHARE * stats["count"]:
                feature["domain"] = sorted(value for value, _ in categorical["top"])
        if numeric and numeric.get("min") is not None:
            feature["range"] = {"min": numeric["min"], "max": numeric["max"]}
            feature["bins"] = default_edges(numeric)
        features[name] = feature
    return {"format": FORMAT, "inferred_from": span, "features": features}


def check(document: Any, what: str = "schema.json") -> dict[str, Any]:
    """``document`` if it is a valid schema.

    Raises:
        SchemaError: naming every wrong field with its path.
    """
    if not isinstance(document, dict):
        raise SchemaError(f"{what}: must be a JSON object, but got {type(document).__name__}")
    problems: list[str] = []
    if document.get("format") != FORMAT:
        problems.append(f"format: must be {FORMAT}, but got {document.get('format')!r}")
    features = document.get("features")
    if not isinstance(features, dict) or not features:
        problems.append("features: must be a non-empty object of column -> rules")
        features = {}
    for name, feature in features.items():
        problems += _feature_problems(f"features.{name}", feature)
    if problems:
        raise SchemaError(f"{what}: " + "; ".join(problems))
    return document


def _feature_problems(where: str, feature: Any) -> list[str]:
    if not isinstance(feature, dict):
        return [f"{where}: must be an object"]
    problems = [f"{where}.{key}: is not a field (fields: {', '.join(sorted(_KEYS))})" for key in feature
                if key not in _KEYS]
    kind = feature.get("type")
    if kind not in TYPES:
        problems.append(f"{where}.type: must be one of {', '.join(TYPES)}, but got {kind!r}")
    if not isinstance(feature.get("required", False), bool):
        problems.append(f"{where}.required: must be true or false")
    domain = feature.get("domain")
    if domain is not None and not (isinstance(domain, list) and all(isinstance(v, str) for v in domain)
                                   and len(set(domain)) == len(domain)):
        problems.append(f"{where}.domain: must be a list of distinct strings")
    value_range = feature.get("range")
    if value_range is not None and not (isinstance(value_range, dict) and set(value_range) == {"min", "max"}
                                        and all(_finite(value_range[k]) for k in ("min", "max"))
                                        and value_range["min"] <= value_range["max"]):
        problems.append(f"{where}.range: must be {{min: number, max: number}} with min <= max")
    bins = feature.get("bins")
    if bins is not None:
        if kind not in NUMERIC_TYPES:
            problems.append(f"{where}.bins: only numeric columns have bins, but the type is {kind!r}")
        elif not (isinstance(bins, list) and 2 <= len(bins) <= MAX_BINS + 1 and all(_finite(e) for e in bins)
                  and all(a < b for a, b in zip(bins, bins[1:], strict=False))):
            problems.append(f"{where}.bins: must be 2 to {MAX_BINS + 1} increasing finite numbers")
    return problems


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def conforms(schema_type: str, observed: str | None) -> bool:
    """Whether a span's observed column type keeps the schema's (None: no value to judge by)."""
    return observed is None or observed == schema_type or (schema_type == "float" and observed == "int")
