"""Model evaluation and blessing: metrics overall and per slice, thresholds, and the decision.

After TFX's Evaluator (TFMA ``MetricThreshold``): a threshold bounds a metric's value
(``lower``/``upper``) and/or its change against the baseline (the last blessed model) with a
``direction``; ``absolute`` and ``relative`` bound the change ``candidate - baseline`` (relative:
divided by ``|baseline|``) as TFMA does: with ``higher_is_better`` the change must be >= the bound
(``absolute: -0.01``: may lose at most 0.01), with ``lower_is_better`` <= it. Every threshold is
judged on the whole span and, unless ``slices: false``, on every value of every slicing column
that has at least ``min_rows`` rows; a smaller slice is reported, not judged.

Every run decides: ``blessed`` is true when no judged check failed. Two cases TFX's users hit are
decided here rather than left without a blessing:

- no thresholds at all: blessed on the candidate's metrics alone (TFX writes no blessing, so a
  pipeline without thresholds could never push);
- no baseline (the first run) or a baseline whose input signature differs from the candidate's
  (a model with new inputs): change thresholds are not judged and the reasons say so; value
  thresholds still are (TFX offers no way past a signature change).

The step's config (``step.json`` of ``evaluate``)::

    label: defect                     # label column (classifiers: class index 0..C-1, or true/false)
    features: [width, height, gloss]  # columns fed to the model's input, in its order
    slices: [line]                    # columns whose values are judged one by one (default none)
    metrics: [accuracy, auc]          # accuracy, error_rate, log_loss, auc (binary) | mae, rmse
    task: binary                      # binary | multiclass | regression (default: from the output's dims)
    output: scores                    # the model output read (default: model.yaml's first output)
    min_rows: 30                      # smallest slice judged (default 30)
    thresholds:
      - {metric: accuracy, lower: 0.8}
      - {metric: auc, change: {direction: higher_is_better, absolute: -0.01}, slices: false}
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

TASKS = ("binary", "multiclass", "regression")
CLASSIFIER_METRICS = ("accuracy", "error_rate", "log_loss", "auc")
REGRESSOR_METRICS = ("mae", "rmse")
METRICS = CLASSIFIER_METRICS + REGRESSOR_METRICS
HIGHER_IS_BETTER = {"accuracy", "auc"}
DIRECTIONS = ("higher_is_better", "lower_is_better")
DEFAULT_MIN_ROWS = 30
MAX_FEATURES = 1_000
MAX_SLICE_COLUMNS = 8
MAX_SLICE_VALUES = 50
"""Most values of one slicing column judged (the most frequent; the others are named as skipped)."""
MAX_THRESHOLDS = 20
"""Most thresholds (with the slice bounds: at most 20 x 401 reasons, a result.json well under 4 MiB)."""
MAX_SLICE_KEY_VALUE_CHARS = 64
"""A slice value longer than this is named by its start and a hash of the whole."""
OVERALL = "overall"
NO_THRESHOLDS = "no thresholds: blessed on the candidate's metrics alone"
_LOG_LOSS_EPS = 1e-15
_KEYS = {"label", "features", "slices", "metrics", "task", "output", "min_rows", "thresholds"}
_THRESHOLD_KEYS = {"metric", "lower", "upper", "change", "slices"}
_CHANGE_KEYS = {"direction", "absolute", "relative"}


class EvaluationError(ValueError):
    """The config or the data cannot be evaluated; ``problems`` lists every one with its path."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = tuple(problems)


@dataclass(frozen=True)
class Change:
    direction: str
    absolute: float | None = None
    relative: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"direction": self.direction}
        if self.absolute is not None:
            out["absolute"] = self.absolute
        if self.relative is not None:
            out["relative"] = self.relative
        return out


@dataclass(frozen=True)
class Threshold:
    metric: str
    lower: float | None = None
    upper: float | None = None
    change: Change | None = None
    slices: bool = True


@dataclass(frozen=True)
class EvalConfig:
    label: str
    features: tuple[str, ...]
    metrics: tuple[str, ...]
    slices: tuple[str, ...] = ()
    thresholds: tuple[Threshold, ...] = ()
    task: str | None = None
    output: str | None = None
    min_rows: int = DEFAULT_MIN_ROWS


# ----------------------------------------------------------------------------------------------
# Config


def config_errors(obj: Any, path: str = "evaluate") -> list[str]:
    """Every rule ``obj`` breaks as an evaluation config, each with its path under ``path``."""
    if not isinstance(obj, Mapping):
        return [f"{path}: must be a mapping, but got {_show(obj)}"]
    problems = [f"{path}.{key}: is not a setting; the settings are {', '.join(sorted(_KEYS))}"
                for key in obj if key not in _KEYS]
    if not _name(obj.get("label")):
        problems.append(f"{path}.label: must be a column name, but got {_show(obj.get('label'))}")
    problems += _names(obj.get("features"), f"{path}.features", required=True, limit=MAX_FEATURES)
    problems += _names(obj.get("slices", []), f"{path}.slices", required=False, limit=MAX_SLICE_COLUMNS)
    task = obj.get("task")
    if task is not None and task not in TASKS:
        problems.append(f"{path}.task: must be one of {', '.join(TASKS)}, but got {_show(task)}")
    if obj.get("output") is not None and not _name(obj.get("output")):
        problems.append(f"{path}.output: must be an output name, but got {_show(obj.get('output'))}")
    min_rows = obj.get("min_rows", DEFAULT_MIN_ROWS)
    if not (_number(min_rows) and float(min_rows).is_integer() and min_rows >= 1):  # a Struct's 30 is 30.0
        problems.append(f"{path}.min_rows: must be an integer >= 1, but got {_show(min_rows)}")
    metrics = obj.get("metrics")
    if not (isinstance(metrics, list) and metrics):
        problems.append(f"{path}.metrics: must be a non-empty list of {', '.join(METRICS)}, but got {_show(metrics)}")
        metrics = []
    for index, metric in enumerate(metrics):
        if metric not in METRICS:
            problems.append(f"{path}.metrics[{index}]: must be one of {', '.join(METRICS)}, but got {_show(metric)}")
        elif task is not None and task in TASKS and metric not in task_metrics(task):
            problems.append(f"{path}.metrics[{index}]: {metric} is not defined for a {task} model "
                            f"(its metrics: {', '.join(task_metrics(task))})")
    if len(set(m for m in metrics if isinstance(m, str))) != len(metrics):
        problems.append(f"{path}.metrics: a metric appears twice")
    thresholds = obj.get("thresholds", [])
    if not isinstance(thresholds, list) or len(thresholds) > MAX_THRESHOLDS:
        problems.append(f"{path}.thresholds: must be a list of at most {MAX_THRESHOLDS} thresholds")
        thresholds = []
    for index, threshold in enumerate(thresholds):
        problems += _threshold_errors(threshold, f"{path}.thresholds[{index}]", metrics)
    return problems


def _threshold_errors(threshold: Any, path: str, metrics: Sequence[Any]) -> list[str]:
    if not isinstance(threshold, Mapping):
        return [f"{path}: must be a mapping with metric and lower/upper/change, but got {_show(threshold)}"]
    problems = [f"{path}.{key}: is not a setting; the settings are {', '.join(sorted(_THRESHOLD_KEYS))}"
                for key in threshold if key not in _THRESHOLD_KEYS]
    metric = threshold.get("metric")
    if metric not in metrics:
        problems.append(f"{path}.metric: must be one of the step's metrics ({', '.join(map(str, metrics))}), "
                        f"but got {_show(metric)}")
    for key in ("lower", "upper"):
        if threshold.get(key) is not None and not _number(threshold[key]):
            problems.append(f"{path}.{key}: must be a number, but got {_show(threshold[key])}")
    if _number(threshold.get("lower")) and _number(threshold.get("upper")) and threshold["lower"] > threshold["upper"]:
        problems.append(f"{path}: lower ({threshold['lower']}) must be <= upper ({threshold['upper']})")
    if not isinstance(threshold.get("slices", True), bool):
        problems.append(f"{path}.slices: must be true or false")
    change = threshold.get("change")
    if change is not None:
        if not isinstance(change, Mapping):
            problems.append(f"{path}.change: must be a mapping with direction, absolute and/or relative")
        else:
            problems += [f"{path}.change.{key}: is not a setting; the settings are {', '.join(sorted(_CHANGE_KEYS))}"
                         for key in change if key not in _CHANGE_KEYS]
            if change.get("direction") is not None and change["direction"] not in DIRECTIONS:
                problems.append(f"{path}.change.direction: must be one of {', '.join(DIRECTIONS)}, "
                                f"but got {_show(change['direction'])}")
            for key in ("absolute", "relative"):
                if change.get(key) is not None and not _number(change[key]):
                    problems.append(f"{path}.change.{key}: must be a number, but got {_show(change[key])}")
            if change.get("absolute") is None and change.get("relative") is None:
                problems.append(f"{path}.change: needs absolute and/or relative")
    if all(threshold.get(key) is None for key in ("lower", "upper", "change")):
        problems.append(f"{path}: needs lower, upper and/or change")
    return problems


def parse_config(obj: Any, path: str = "evaluate") -> EvalConfig:
    """Raises: EvaluationError listing every problem (see :func:`config_errors`)."""
    problems = config_errors(obj, path)
    if problems:
        raise EvaluationError(problems)
    thresholds = []
    for item in obj.get("thresholds", []):
        change = item.get("change")
        thresholds.append(Threshold(
            item["metric"], item.get("lower"), item.get("upper"),
            Change(change.get("direction") or _natural_direction(item["metric"]), change.get("absolute"),
                   change.get("relative")) if change is not None else None,
            item.get("slices", True)))
    return EvalConfig(obj["label"], tuple(obj["features"]), tuple(obj["metrics"]), tuple(obj.get("slices", [])),
                      tuple(thresholds), obj.get("task"), obj.get("output"), int(obj.get("min_rows", DEFAULT_MIN_ROWS)))


def task_metrics(task: str) -> tuple[str, ...]:
    if task == "regression":
        return REGRESSOR_METRICS
    if task == "multiclass":
        return ("accuracy", "error_rate", "log_loss")
    return CLASSIFIER_METRICS


def _natural_direction(metric: str) -> str:
    return "higher_is_better" if metric in HIGHER_IS_BETTER else "lower_is_better"


def _names(value: Any, path: str, *, required: bool, limit: int) -> list[str]:
    if not isinstance(value, list) or (required and not value) or len(value) > limit:
        return [f"{path}: must be a {'non-empty ' if required else ''}list of at most {limit} column names, "
                f"but got {_show(value)}"]
    problems = [f"{path}[{i}]: must be a column name, but got {_show(v)}" for i, v in enumerate(value) if not _name(v)]
    names = [v for v in value if _name(v)]
    if len(set(names)) != len(names):
        problems.append(f"{path}: a column appears twice")
    return problems


def _name(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 256


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ----------------------------------------------------------------------------------------------
# Metrics


def metric_values(task: str, names: Sequence[str], labels: np.ndarray, outputs: np.ndarray) -> dict[str, Any]:
    """``names``' values on rows with ``labels`` and the model's ``outputs`` (classifiers: probabilities
    ``[n, classes]``, or ``[n]``/``[n, 1]`` = P(class 1) of a binary one; regressors: ``[n]``/``[n, 1]``).
    A metric undefined on these rows (auc with one class) is None."""
    out: dict[str, Any] = {"rows": int(len(labels))}
    if len(labels) == 0:
        return out | {name: None for name in names}
    if task == "regression":
        predicted = outputs.reshape(len(labels))
        errors = predicted - labels
        values = {"mae": float(np.abs(errors).mean()), "rmse": float(math.sqrt(float((errors ** 2).mean())))}
    else:
        scores = class_scores(outputs)
        truth = labels.astype(np.int64)
        predicted = scores.argmax(axis=1)
        accuracy = float((predicted == truth).mean())
        picked = np.clip(scores[np.arange(len(truth)), truth], _LOG_LOSS_EPS, 1.0)
        values = {"accuracy": accuracy, "error_rate": 1.0 - accuracy, "log_loss": float(-np.log(picked).mean()),
                  "auc": binary_auc(truth, scores[:, 1]) if scores.shape[1] == 2 else None}
    return out | {name: values.get(name) for name in names}


def class_scores(outputs: np.ndarray) -> np.ndarray:
    """Scores as ``[n, classes]`` (a binary model's single P(class 1) column becomes ``[1 - p, p]``)."""
    scores = np.asarray(outputs, dtype=np.float64)
    if scores.ndim == 1:
        scores = scores[:, None]
    if scores.shape[1] == 1:
        scores = np.hstack([1.0 - scores, scores])
    return scores


def binary_auc(truth: np.ndarray, positive: np.ndarray) -> float | None:
    """ROC AUC as the Mann-Whitney U statistic (ties count half); None with one class only."""
    positives = int((truth == 1).sum())
    negatives = len(truth) - positives
    if positives == 0 or negatives == 0:
        return None
    order = np.argsort(positive, kind="mergesort")
    _, first, counts = np.unique(positive[order], return_index=True, return_counts=True)
    ranks = np.empty(len(positive), dtype=np.float64)
    ranks[order] = np.repeat(first + (counts - 1) / 2 + 1, counts)  # tied scores share their mean rank
    rank_sum = float(ranks[truth == 1].sum())
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def sliced_metrics(task: str, names: Sequence[str], labels: np.ndarray, outputs: np.ndarray,
                   slices: Mapping[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """The metrics on every row (``overall``) and on each slice's rows (``slices``: key -> row mask)."""
    result = {OVERALL: metric_values(task, names, labels, outputs)}
    for key, mask in slices.items():
        result[key] = metric_values(task, names, labels[mask], outputs[mask])
    return result


def slice_masks(columns: Mapping[str, Sequence[str | None]]) -> tuple[dict[str, np.ndarray], list[str]]:
    """Row masks per ``column=value`` (missing values are in no slice), the :data:`MAX_SLICE_VALUES`
    most frequent values of each column, and notes naming the columns whose other values were left out."""
    masks: dict[str, np.ndarray] = {}
    notes: list[str] = []
    for column, values in columns.items():
        array = np.array(["" if v is None else v for v in values], dtype=object)
        present = np.array([v is not None for v in values], dtype=bool)
        distinct, counts = np.unique(array[present].astype(str), return_counts=True)
        order = np.argsort(-counts, kind="stable")
        if len(distinct) > MAX_SLICE_VALUES:
            notes.append(f"slice column {column!r} has {len(distinct)} values; the {MAX_SLICE_VALUES} most frequent "
                         "are judged")
        for index in sorted(order[:MAX_SLICE_VALUES], key=lambda i: distinct[i]):
            masks[f"{column}={_shown_value(distinct[index])}"] = present & (array == distinct[index])
    return masks, notes


def _shown_value(value: str) -> str:
    if len(value) <= MAX_SLICE_KEY_VALUE_CHARS:
        return value
    digest = hashlib.sha256(value.encode()).hexdigest()[:12]
    return f"{value[:MAX_SLICE_KEY_VALUE_CHARS - 15]}...{digest}"  # 64 characters in all


# ----------------------------------------------------------------------------------------------
# Blessing


@dataclass(frozen=True)
class Reason:
    metric: str | None
    slice: str | None
    value: float | None
    threshold: Any
    baseline_value: float | None
    passed: bool | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "slice": self.slice, "value": self.value, "threshold": self.threshold,
                "baseline_value": self.baseline_value, "passed": self.passed, "message": self.message}


def judge(config: EvalConfig, candidate: Mapping[str, Mapping[str, Any]],
          baseline: Mapping[str, Mapping[str, Any]] | None, *, no_baseline_why: str | None = None
          ) -> tuple[bool, list[Reason]]:
    """Whether the candidate is blessed, and one reason per check made or not made.

    ``candidate``/``baseline``: :func:`sliced_metrics` of each model on the same rows; ``baseline``
    None with ``no_baseline_why`` saying why (first run, signature changed)."""
    reasons: list[Reason] = []
    judged = [OVERALL]
    for key, values in candidate.items():
        if key == OVERALL:
            continue
        if values["rows"] >= config.min_rows:
            judged.append(key)
        else:
            reasons.append(Reason(None, key, None, {"min_rows": config.min_rows}, None, None,
                                  f"slice {key} has {values['rows']} rows, fewer than min_rows {config.min_rows}: "
                                  "reported, not judged"))
    if not config.thresholds:
        reasons.append(Reason(None, None, None, None, None, True, NO_THRESHOLDS))
        return True, reasons
    for threshold in config.thresholds:
        for key in judged if threshold.slices else [OVERALL]:
            reasons += _value_reasons(threshold, key, candidate[key].get(threshold.metric))
            if threshold.change is None:
                continue
            if baseline is None:
                if key == OVERALL:
                    reasons.append(Reason(threshold.metric, None, candidate[key].get(threshold.metric),
                                          threshold.change.to_dict(), None, None,
                                          f"change threshold on {threshold.metric} not judged: {no_baseline_why}"))
                continue
            reasons.append(_change_reason(threshold, key, candidate[key].get(threshold.metric),
                                          baseline.get(key, {}).get(threshold.metric)))
    return all(reason.passed is not False for reason in reasons), reasons


def _label(key: str) -> str:
    return "overall" if key == OVERALL else f"slice {key}"


def _value_reasons(threshold: Threshold, key: str, value: float | None) -> list[Reason]:
    if threshold.lower is None and threshold.upper is None:
        return []
    bounds = {k: v for k, v in (("lower", threshold.lower), ("upper", threshold.upper)) if v is not None}
    slice_name = None if key == OVERALL else key
    if value is None:
        return [Reason(threshold.metric, slice_name, None, bounds, None, None,
                       f"{threshold.metric} is not defined on {_label(key)} (one class only): not judged")]
    low_ok = threshold.lower is None or value >= threshold.lower
    high_ok = threshold.upper is None or value <= threshold.upper
    passed = low_ok and high_ok
    what = " and ".join(f"{'>=' if k == 'lower' else '<='} {v}" for k, v in bounds.items())
    return [Reason(threshold.metric, slice_name, value, bounds, None, passed,
                   f"{threshold.metric} {value:.4g} on {_label(key)} {'meets' if passed else 'fails'} {what}")]


def _change_reason(threshold: Threshold, key: str, value: float | None, before: float | None) -> Reason:
    change = threshold.change
    assert change is not None
    slice_name = None if key == OVERALL else key
    if value is None or before is None:
        return Reason(threshold.metric, slice_name, value, change.to_dict(), before, None,
                      f"{threshold.metric} change on {_label(key)} not judged: undefined for "
                      f"{'the candidate' if value is None else 'the baseline'}")
    diff = value - before
    relative = diff / abs(before) if before != 0 else (0.0 if diff == 0 else math.copysign(math.inf, diff))
    higher = change.direction == "higher_is_better"
    checks = []
    if change.absolute is not None:
        checks.append(("absolute", diff, change.absolute))
    if change.relative is not None:
        checks.append(("relative", relative, change.relative))
    failed = [(kind, got, bound) for kind, got, bound in checks if (got < bound if higher else got > bound)]
    shown = ", ".join(f"{kind} change {got:+.4g} ({'>=' if higher else '<='} {bound})" for kind, got, bound in checks)
    passed = not failed
    return Reason(threshold.metric, slice_name, value, change.to_dict(), before, passed,
                  f"{threshold.metric} on {_label(key)}: {value:.4g} vs baseline {before:.4g}, {shown}: "
                  f"{'passes' if passed else 'fails'} ({change.direction})")
