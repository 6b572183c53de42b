"""A model's monitoring config (``monitoring.yaml`` in its bundle, or given to RegisterModel), validated
with every wrong field path reported at once.

```yaml
task: binary                # binary | multiclass | regression (default: from the reference's scores)
features:                   # how request tensors become named features (default: one feature per
  input0: [age, income]     #   column, named tensor[i], or the tensor's name when it has one column)
outputs:
  scores: probabilities     # classifiers' class-score tensor (default: the first float output)
  predicted: label          # predicted class/value tensor (default: argmax of scores; regression: first output)
window: {count: 500, seconds: 300}   # a window closes at `count` predictions or `seconds` of event time
drift: {method: auto, methods: {age: psi}, thresholds: {age: 0.2}}
rules: [...]                # see rules.py
labels: {producers: [plant-3/qa]}   # CloudEvents sources whose labels of this model are accepted, besides
                                    #   the platform's (OPML_MONITORING_SCORER_LABEL_SOURCES)
segment: {parameter: line}          # windows, estimates, drift and alerts per value of this KServe v2
                                    #   request parameter too (segments.py), besides the whole version's
```
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from opml_common.errors import InvalidArgument, brief
from opml_common.yamlsafe import load_yaml
from opml_monitoring_scorer.core.drift import METHODS
from opml_monitoring_scorer.core.reference import Task
from opml_monitoring_scorer.core.rules import Rule, parse_rules

MAX_CONFIG_BYTES = 256 * 1024
MAX_PRODUCERS = 64
MAX_PRODUCER_CHARS = 256
_KEYS = {"task", "features", "outputs", "window", "drift", "rules", "labels", "segment"}
MAX_PARAMETER_CHARS = 64


@dataclass(frozen=True)
class WindowSpec:
    """A window closes at ``count`` predictions or when ``seconds`` of event time have passed since its
    first (either may be None, not both)."""

    count: int | None = 1000
    seconds: float | None = None


@dataclass(frozen=True)
class MonitoringConfig:
    task: Task | None = None
    feature_names: dict[str, list[str]] = field(default_factory=dict)
    scores_output: str | None = None
    predicted_output: str | None = None
    window: WindowSpec = WindowSpec()
    drift_methods: dict[str, str] = field(default_factory=dict)
    drift_thresholds: dict[str, float] = field(default_factory=dict)
    rules: tuple[Rule, ...] = ()
    label_producers: frozenset[str] = frozenset()
    """Sources (``ce_source``) whose labels of this model are accepted, besides the platform's."""
    segment_parameter: str | None = None
    """The KServe v2 request parameter whose value names a prediction's segment (None: no segments)."""

    @classmethod
    def parse(cls, text: str | bytes, *, what: str = "monitoring.yaml") -> MonitoringConfig:
        """Raises: InvalidArgument: every wrong field (``window.count``, ``rules[1].under``...) at once,
        or the document's own problem with its line and column."""
        data = load_yaml(text, what=what, max_bytes=MAX_CONFIG_BYTES)
        return cls.from_dict({} if data is None else data, what=what)

    @classmethod
    def from_dict(cls, data: Any, *, what: str = "monitoring.yaml") -> MonitoringConfig:
        if not isinstance(data, Mapping):
            raise InvalidArgument(what, f"must be a mapping, but got {brief(data)}")
        problems: list[tuple[str, str]] = []
        for key in data:
            if key not in _KEYS:
                problems.append((str(key), f"is not a setting; the settings are {', '.join(sorted(_KEYS))}"))
        task = None
        if data.get("task") is not None:
            try:
                task = Task(data["task"])
            except ValueError:
                problems.append(("task", f"must be one of {', '.join(t.value for t in Task)}, "
                                         f"but got {brief(data['task'])}"))
        feature_names = _names(data.get("features") or {}, problems)
        outputs = data.get("outputs") or {}
        if not isinstance(outputs, Mapping):
            problems.append(("outputs", "must be a mapping of scores/predicted to tensor names"))
            outputs = {}
        for key, value in outputs.items():
            if key not in ("scores", "predicted"):
                problems.append((f"outputs.{key}", "is not a setting; use scores or predicted"))
            elif not isinstance(value, str) or not value:
                problems.append((f"outputs.{key}", f"must be a tensor name, but got {brief(value)}"))
        window = _window(data.get("window"), problems)
        producers = _producers(data.get("labels"), problems)
        segment = _segment(data.get("segment"), problems)
        methods, thresholds = _drift(data.get("drift") or {}, problems)
        rules: tuple[Rule, ...] = ()
        try:
            rules = parse_rules(data.get("rules") or [], path="rules")
        except InvalidArgument as exc:
            problems.extend(exc.violations)
        if problems:
            raise InvalidArgument.of(problems)
        return cls(task=task, feature_names=feature_names, scores_output=outputs.get("scores"),
                   predicted_output=outputs.get("predicted"), window=window, drift_methods=methods,
                   drift_thresholds=thresholds, rules=rules, label_producers=producers, segment_parameter=segment)


def _segment(segment: Any, problems: list) -> str | None:
    if segment is None:
        return None
    if not isinstance(segment, Mapping):
        problems.append(("segment", f"must be a mapping with parameter, as in {{parameter: line}}, but got "
                                    f"{brief(segment)}"))
        return None
    for key in segment:
        if key != "parameter":
            problems.append((f"segment.{key}", "is not a setting; use parameter"))
    parameter = segment.get("parameter")
    if not isinstance(parameter, str) or not 0 < len(parameter) <= MAX_PARAMETER_CHARS:
        problems.append(("segment.parameter", f"must name a request parameter in 1-{MAX_PARAMETER_CHARS} characters, "
                                              f"but got {brief(parameter)}"))
        return None
    return parameter


def _producers(labels: Any, problems: list) -> frozenset[str]:
    if labels is None:
        return frozenset()
    if not isinstance(labels, Mapping):
        problems.append(("labels", f"must be a mapping with producers, but got {brief(labels)}"))
        return frozenset()
    for key in labels:
        if key != "producers":
            problems.append((f"labels.{key}", "is not a setting; use producers"))
    producers = labels.get("producers") or []
    if not isinstance(producers, list) or len(producers) > MAX_PRODUCERS:
        problems.append(("labels.producers", f"must be a list of at most {MAX_PRODUCERS} CloudEvents sources, "
                                             f"but got {brief(producers)}"))
        return frozenset()
    for i, producer in enumerate(producers):
        if not isinstance(producer, str) or not 0 < len(producer) <= MAX_PRODUCER_CHARS:
            problems.append((f"labels.producers[{i}]", f"must be a source of 1-{MAX_PRODUCER_CHARS} characters, "
                                                       f"but got {brief(producer)}"))
    return frozenset(p for p in producers if isinstance(p, str) and 0 < len(p) <= MAX_PRODUCER_CHARS)


def _names(features: Any, problems: list) -> dict[str, list[str]]:
    if not isinstance(features, Mapping):
        problems.append(("features", f"must map tensor names to lists of feature names, but got {brief(features)}"))
        return {}
    out = {}
    for tensor, names in features.items():
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
            problems.append((f"features.{tensor}", f"must be a non-empty list of feature names, but got {brief(names)}"))
        elif len(set(names)) != len(names):
            problems.append((f"features.{tensor}", "names each feature once"))
        else:
            out[str(tensor)] = list(names)
    return out


def _window(window: Any, problems: list) -> WindowSpec:
    if window is None:
        return WindowSpec()
    if not isinstance(window, Mapping):
        problems.append(("window", f"must be a mapping with count and/or seconds, but got {brief(window)}"))
        return WindowSpec()
    for key in window:
        if key not in ("count", "seconds"):
            problems.append((f"window.{key}", "is not a setting; use count or seconds"))
    count, seconds = window.get("count"), window.get("seconds")
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or not 10 <= count <= 1_000_000):
        problems.append(("window.count", f"must be an integer in [10, 1000000], but got {brief(count)}"))
    if seconds is not None and (not isinstance(seconds, (int, float)) or isinstance(seconds, bool)
                                or not 1 <= seconds <= 86_400 * 7):
        problems.append(("window.seconds", f"must be a number of seconds in [1, 604800], but got {brief(seconds)}"))
    if count is None and seconds is None:
        problems.append(("window", "must set count, seconds or both"))
    return WindowSpec(count=count, seconds=None if seconds is None else float(seconds))


def _drift(drift: Any, problems: list) -> tuple[dict[str, str], dict[str, float]]:
    if not isinstance(drift, Mapping):
        problems.append(("drift", f"must be a mapping, but got {brief(drift)}"))
        return {}, {}
    methods: dict[str, str] = {}
    thresholds: dict[str, float] = {}
    for key in drift:
        if key not in ("method", "methods", "thresholds"):
            problems.append((f"drift.{key}", "is not a setting; use method, methods or thresholds"))
    if "method" in drift:
        if drift["method"] not in METHODS:
            problems.append(("drift.method", f"must be one of {', '.join(METHODS)}, but got {brief(drift['method'])}"))
        else:
            methods["*"] = drift["method"]
    for name, method in _by_feature(drift, "methods", "drift.methods: {age: psi}", problems).items():
        if method not in METHODS:
            problems.append((f"drift.methods.{name}", f"must be one of {', '.join(METHODS)}, but got {brief(method)}"))
        else:
            methods[str(name)] = method
    for name, value in _by_feature(drift, "thresholds", "drift.thresholds: {age: 0.2}", problems).items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            problems.append((f"drift.thresholds.{name}", f"must be a number > 0, but got {brief(value)}"))
        else:
            thresholds[str(name)] = float(value)
    return methods, thresholds


def _by_feature(drift: Mapping, key: str, example: str, problems: list) -> Mapping:
    value = drift.get(key) or {}
    if not isinstance(value, Mapping):
        problems.append((f"drift.{key}", f"must map feature names (or *) to values, as in {example}, "
                                         f"but got {brief(value)}"))
        return {}
    return value
