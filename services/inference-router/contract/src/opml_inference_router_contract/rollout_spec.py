"""The rollout spec a bundle may carry beside ``model.yaml`` (``rollout.yaml``): how a new version of
the model takes traffic from the stable one, step by step, with analyses that decide on the way.

It is a file of its own, not a section of ``model.yaml``: the model config says what a model needs to
be served (workers read it too), the rollout says how one delivery of it proceeds; the same model can
be delivered with another rollout without changing its config. Producers validate it here, with the
router's rules, through :func:`load_rollout_spec` / :meth:`RolloutSpec.from_dict`.

Example::

    steps:
      - shadow: {percent: 20}     # a copy of 20% of the requests also to the new version; callers get
                                  # the stable version's answers only
      - analysis:
          interval_s: 30
          checks:
            disagreement: {max_share: 0.02, min_requests: 200}   # the two versions' outputs compared
            error_rate: {max_increase: 0.01}                     # of the mirrored requests
      - weight: 10                # 10% of the model's traffic to the new version
      - analysis:                 # measured over each interval, new version against stable
          interval_s: 30
          count: 4                # measurements; all must pass (within the limits) to go on
          failure_limit: 0        # more failed measurements than this: abort (back to stable)
          inconclusive_limit: 1   # more inconclusive ones than this: pause, saying why
          checks:
            error_rate: {max_increase: 0.01, min_requests: 100}
            p99_latency: {max_ratio: 1.5, min_requests: 100}
            estimated_accuracy: {max_drop: 0.02, min_predictions: 500}  # the monitoring-scorer's
      - pause: {duration_s: 60}   # or {} : until resumed
      - weight: 50
      - analysis: {interval_s: 30, count: 4, checks: {error_rate: {max_increase: 0.01}}}

After the last step the new version is promoted. Checks compare the new version with the stable one:

* from the router's own measures over the same interval: ``error_rate`` (failed / all requests;
  passes when new - stable <= ``max_increase``) and ``p99_latency`` (passes when new / stable <=
  ``max_ratio``); fewer than ``min_requests`` requests to either version make it inconclusive. The
  requests a shadow step mirrors count for the new version;
* from a shadow step's mirrored requests: ``disagreement`` (the share of compared rows whose outputs
  differ: another class for a classifier, a relative difference over the step's ``tolerance`` for a
  regressor; passes when <= ``max_share``); fewer than ``min_requests`` compared requests:
  inconclusive. It needs a shadow step before it;
* from the monitoring-scorer's windows of each version since the analysis began:
  ``estimated_accuracy`` (its label-free estimate) and ``accuracy`` (from the labels joined so far);
  each passes when the new version is worse than the stable one by at most ``max_drop`` (accuracy
  points; for a regressor, MAE). Fewer than ``min_predictions`` scored predictions (``min_labels``
  labels for ``accuracy``) of either version: inconclusive.

A shadow step's ``output`` (default: the model's first) must be comparable, which the model config
says (:func:`RolloutSpec.from_dict` with ``model``): a number type, with one value per row (a
regressor, or a class index) or a fixed number of class scores per row; a string, a dynamic or a
many-dimensional output is refused at validation.

Every mistake is reported at once: :class:`~opml_common.errors.InvalidArgument` holds one violation
per bad field, each named by its path (``steps[2].analysis.checks.error_rate.max_increase``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opml_common.errors import InvalidArgument, brief
from opml_inference_router_contract.model_config import ModelConfig, TensorSpec, read_document

ROLLOUT_FILE = "rollout.yaml"
"""Where a bundle carries its rollout spec (beside ``model.yaml``)."""

ERROR_RATE, P99_LATENCY, DISAGREEMENT = "error_rate", "p99_latency", "disagreement"
ESTIMATED_ACCURACY, ACCURACY = "estimated_accuracy", "accuracy"
CHECKS = (ERROR_RATE, P99_LATENCY, DISAGREEMENT, ESTIMATED_ACCURACY, ACCURACY)
"""The checks an analysis may run."""
QUALITY_CHECKS = (ESTIMATED_ACCURACY, ACCURACY)
"""The checks the monitoring-scorer's windows decide."""

CLASSES, SCORES, VALUES = "classes", "scores", "values"
"""How a shadow step compares an output row: a class index, a vector of class scores (its argmax),
or a value (a relative difference over ``tolerance``)."""

MAX_STEPS = 64
MAX_INTERVAL_S = 24 * 3600.0
MAX_COUNT = 10_000
DEFAULT_MIN_REQUESTS = 50
DEFAULT_TOLERANCE = 0.01
_NUMBER_TYPES = frozenset({"uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
                           "fp16", "bf16", "fp32", "fp64", "bool"})
_INTEGER_TYPES = frozenset({"uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "bool"})


@dataclass(frozen=True)
class Check:
    """One comparison of the new version with the stable one; ``bound`` is ``max_increase`` for
    error_rate (an absolute rate difference), ``max_ratio`` for p99_latency, ``max_share`` for
    disagreement, ``max_drop`` for estimated_accuracy and accuracy. ``min_requests``: the fewest
    requests (compared requests, scored predictions or labels: :data:`MINIMA` names it) to count."""

    name: str
    bound: float
    min_requests: int = DEFAULT_MIN_REQUESTS

    @property
    def bound_name(self) -> str:
        return BOUNDS[self.name]

    @property
    def minimum_name(self) -> str:
        return MINIMA[self.name]


@dataclass(frozen=True)
class Shadow:
    """Mirror ``percent`` of the requests the stable version answers to the new version, and compare
    the two versions' ``output`` (default: the model's first), as :func:`comparison_of` its config says."""

    percent: float
    output: str = ""
    tolerance: float = DEFAULT_TOLERANCE


@dataclass(frozen=True)
class Analysis:
    interval_s: float
    count: int = 1
    failure_limit: int = 0
    inconclusive_limit: int = 0
    checks: tuple[Check, ...] = ()


@dataclass(frozen=True)
class Step:
    """Exactly one of: ``weight`` (percent of traffic to the new version), ``shadow`` (a share of the
    requests mirrored to it), ``pause`` (``pause_s`` seconds, or None: until resumed), ``analysis``."""

    weight: float | None = None
    pause: bool = False
    pause_s: float | None = None
    analysis: Analysis | None = None
    shadow: Shadow | None = None

    @property
    def kind(self) -> str:
        if self.weight is not None:
            return "weight"
        if self.shadow is not None:
            return "shadow"
        return "pause" if self.pause else "analysis"


@dataclass(frozen=True)
class RolloutSpec:
    steps: tuple[Step, ...] = field(default_factory=tuple)

    @classmethod
    def from_dict(cls, data: Any, *, model: ModelConfig | None = None) -> RolloutSpec:
        """``model``: the config of the model rolled out; a shadow step's output is checked against it
        (comparable, as the comparator reads it) and its comparison fixed. Without it (a spec checked on
        its own) the outputs are not checked.

        Raises: InvalidArgument with one violation per bad field."""
        problems: list[tuple[str, str]] = []
        spec = _spec(data, problems, model)
        if problems:
            raise InvalidArgument.of(problems)
        return spec

    def shadow_at(self, index: int) -> Shadow | None:
        """The mirror in force at step ``index``: the last shadow step at or before it, unless a weight
        step came after that one (the new version then takes traffic of its own)."""
        for step in reversed(self.steps[:index + 1]):
            if step.weight is not None:
                return None
            if step.shadow is not None:
                return step.shadow
        return None

    def to_dict(self) -> dict[str, Any]:
        """The spec as :meth:`from_dict` reads it (what the control plane stores)."""
        steps: list[dict[str, Any]] = []
        for step in self.steps:
            if step.weight is not None:
                steps.append({"weight": step.weight})
            elif step.shadow is not None:
                shadow = step.shadow
                steps.append({"shadow": {"percent": shadow.percent, "tolerance": shadow.tolerance,
                                         **({"output": shadow.output} if shadow.output else {})}})
            elif step.pause:
                steps.append({"pause": {} if step.pause_s is None else {"duration_s": step.pause_s}})
            elif step.analysis is not None:
                a = step.analysis
                checks = {c.name: {c.bound_name: c.bound, c.minimum_name: c.min_requests} for c in a.checks}
                steps.append({"analysis": {"interval_s": a.interval_s, "count": a.count,
                                           "failure_limit": a.failure_limit,
                                           "inconclusive_limit": a.inconclusive_limit, "checks": checks}})
        return {"steps": steps}


def load_rollout_spec(path: str | Path, *, model: ModelConfig | None = None) -> RolloutSpec:
    """Reads a rollout spec from a YAML or JSON file (``model``: as :meth:`RolloutSpec.from_dict`).

    Raises: NotFound (no file), InvalidArgument (not YAML/JSON, or fields break rules: all named).
    """
    return RolloutSpec.from_dict(read_document(Path(path)), model=model)


def comparison_of(output: TensorSpec, max_batch_size: int) -> str | None:
    """How a shadow step compares rows of ``output`` (:data:`CLASSES`, :data:`SCORES`, :data:`VALUES`),
    or None when it cannot: not a number, or not one value or a fixed vector per row."""
    if output.data_type not in _NUMBER_TYPES:
        return None
    per_row = output.dims if max_batch_size > 0 else output.dims[1:]
    if any(dim == -1 for dim in per_row) or len(per_row) > 1:
        return None
    if not per_row or per_row[0] == 1:
        return CLASSES if output.data_type in _INTEGER_TYPES else VALUES
    return SCORES


# ----------------------------------------------------------------------------------------------

BOUNDS = {ERROR_RATE: "max_increase", P99_LATENCY: "max_ratio", DISAGREEMENT: "max_share",
          ESTIMATED_ACCURACY: "max_drop", ACCURACY: "max_drop"}
"""Each check's bound field."""
MINIMA = {ERROR_RATE: "min_requests", P99_LATENCY: "min_requests", DISAGREEMENT: "min_requests",
          ESTIMATED_ACCURACY: "min_predictions", ACCURACY: "min_labels"}
"""Each check's minimum field: below it, the check is inconclusive."""
_BOUND_RULES = {ERROR_RATE: (0.0, 1.0, "a rate difference"), P99_LATENCY: (1.0, 1000.0, "a ratio"),
                DISAGREEMENT: (0.0, 1.0, "a share"), ESTIMATED_ACCURACY: (0.0, 1e9, "a quality difference"),
                ACCURACY: (0.0, 1e9, "a quality difference")}


def _spec(data: Any, problems: list[tuple[str, str]], model: ModelConfig | None = None) -> RolloutSpec:
    if not isinstance(data, Mapping):
        problems.append(("rollout", f"must be a mapping with `steps`, but got {type(data).__name__}"))
        return RolloutSpec()
    _unknown(data, {"steps"}, "", problems)
    raw = data.get("steps")
    if not isinstance(raw, list) or not raw:
        problems.append(("steps", f"must be a non-empty list of steps, but got {brief(raw)}"))
        return RolloutSpec()
    if len(raw) > MAX_STEPS:
        problems.append(("steps", f"must hold at most {MAX_STEPS} steps, but holds {len(raw)}"))
        return RolloutSpec()
    steps = tuple(_step(item, f"steps[{index}]", problems, model) for index, item in enumerate(raw))
    _order(steps, problems)
    return RolloutSpec(steps)


def _step(data: Any, path: str, problems: list[tuple[str, str]], model: ModelConfig | None) -> Step:
    if (not isinstance(data, Mapping) or len(data) != 1
            or next(iter(data)) not in ("weight", "shadow", "pause", "analysis")):
        problems.append((path, f"must be one of {{weight: PCT}}, {{shadow: {{percent: PCT}}}}, {{pause: {{...}}}}, "
                               f"{{analysis: {{...}}}}, but got {brief(data)}"))
        return Step(pause=True, pause_s=0.0)
    kind, value = next(iter(data.items()))
    if kind == "shadow":
        return Step(shadow=_shadow(value, f"{path}.shadow", problems, model))
    if kind == "weight":
        if not _number(value) or not 0 < value < 100:
            problems.append((f"{path}.weight", f"must be a percent in (0, 100) (all traffic is the promotion after "
                                               f"the last step), but got {brief(value)}"))
            return Step(weight=0.0)
        return Step(weight=float(value))
    if kind == "pause":
        return _pause(value, f"{path}.pause", problems)
    return Step(analysis=_analysis(value, f"{path}.analysis", problems))


def _pause(data: Any, path: str, problems: list[tuple[str, str]]) -> Step:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        problems.append((path, f"must be {{}} (until resumed) or {{duration_s: S}}, but got {brief(data)}"))
        return Step(pause=True, pause_s=0.0)
    _unknown(data, {"duration_s"}, path, problems)
    seconds = data.get("duration_s")
    if seconds is not None and (not _number(seconds) or not 0 < seconds <= MAX_INTERVAL_S):
        problems.append((f"{path}.duration_s", f"must be seconds in (0, {MAX_INTERVAL_S:g}], but got {brief(seconds)}"))
        seconds = 0.0
    return Step(pause=True, pause_s=None if seconds is None else float(seconds))


def _shadow(data: Any, path: str, problems: list[tuple[str, str]], model: ModelConfig | None) -> Shadow:
    if not isinstance(data, Mapping):
        problems.append((path, f"must be a mapping with percent (and output, tolerance), but got {brief(data)}"))
        return Shadow(0.0)
    _unknown(data, {"percent", "output", "tolerance"}, path, problems)
    percent = data.get("percent")
    if not _number(percent) or not 0 < percent <= 100:
        problems.append((f"{path}.percent", f"must be a percent in (0, 100] of the requests the stable version "
                                            f"answers, but got {brief(percent)}"))
        percent = 0.0
    tolerance = data.get("tolerance", DEFAULT_TOLERANCE)
    if not _number(tolerance) or not 0 <= tolerance <= 1e6:
        problems.append((f"{path}.tolerance", f"must be a relative difference in [0, 1e6], but got {brief(tolerance)}"))
        tolerance = DEFAULT_TOLERANCE
    output = data.get("output", "")
    if not isinstance(output, str):
        problems.append((f"{path}.output", f"must be the name of one of the model's outputs, but got {brief(output)}"))
        output = ""
    if model is not None:
        outputs = {spec.name: spec for spec in model.outputs}
        spec = outputs.get(output) if output else model.outputs[0]
        if spec is None:
            problems.append((f"{path}.output", f"is not an output of model {model.name} (outputs: "
                                               f"{', '.join(outputs)})"))
        else:
            if comparison_of(spec, model.max_batch_size) is None:
                problems.append((f"{path}.output" if output else path,
                                 f"cannot be compared: model {model.name}'s output {spec.name} is {spec.data_type} "
                                 f"with dims {list(spec.dims)}; a shadow step compares a number type with one value "
                                 f"or a fixed number of class scores per row"))
            output = spec.name
    return Shadow(float(percent), output, float(tolerance))


def _analysis(data: Any, path: str, problems: list[tuple[str, str]]) -> Analysis:
    if not isinstance(data, Mapping):
        problems.append((path, f"must be a mapping with interval_s and checks, but got {brief(data)}"))
        return Analysis(interval_s=0.0)
    _unknown(data, {"interval_s", "count", "failure_limit", "inconclusive_limit", "checks"}, path, problems)
    interval = data.get("interval_s")
    if not _number(interval) or not 0 < interval <= MAX_INTERVAL_S:
        problems.append((f"{path}.interval_s", f"must be seconds in (0, {MAX_INTERVAL_S:g}], but got {brief(interval)}"))
        interval = 0.0
    count = _integer(data, "count", 1, 1, MAX_COUNT, path, problems)
    failures = _integer(data, "failure_limit", 0, 0, MAX_COUNT, path, problems)
    inconclusive = _integer(data, "inconclusive_limit", 0, 0, MAX_COUNT, path, problems)
    checks_data = data.get("checks")
    checks: list[Check] = []
    if not isinstance(checks_data, Mapping) or not checks_data:
        problems.append((f"{path}.checks", f"must map at least one of {', '.join(CHECKS)} to its bounds, "
                                           f"but got {brief(checks_data)}"))
    else:
        for name, bounds in checks_data.items():
            check = _check(name, bounds, f"{path}.checks.{name}", problems)
            if check is not None:
                checks.append(check)
    return Analysis(float(interval), count, failures, inconclusive, tuple(checks))


def _check(name: Any, data: Any, path: str, problems: list[tuple[str, str]]) -> Check | None:
    if name not in CHECKS:
        problems.append((path, f"is not a check (checks: {', '.join(CHECKS)})"))
        return None
    bound_name, minimum_name = BOUNDS[name], MINIMA[name]
    if not isinstance(data, Mapping):
        problems.append((path, f"must be a mapping with {bound_name}, but got {brief(data)}"))
        return None
    _unknown(data, {bound_name, minimum_name}, path, problems)
    bound = data.get(bound_name)
    low, high, what = _BOUND_RULES[name]
    if not _number(bound) or not low <= bound <= high:
        problems.append((f"{path}.{bound_name}", f"must be {what} in [{low:g}, {high:g}], but got {brief(bound)}"))
    minimum = _integer(data, minimum_name, DEFAULT_MIN_REQUESTS, 1, 10**9, path, problems)
    return Check(name, float(bound) if _number(bound) else 0.0, minimum)


def _order(steps: tuple[Step, ...], problems: list[tuple[str, str]]) -> None:
    """Rules across steps: an analysis measures the new version, so one must take traffic (or mirrored
    requests) before it, and a disagreement check needs a shadow step in force; a pause until resumed
    must be followed by an analysis (else it is a manual canary: deploy with ``canary`` instead)."""
    weighted = False
    for index, step in enumerate(steps):
        if step.weight is not None or step.shadow is not None:
            weighted = True
        elif step.analysis is not None and not weighted:
            problems.append((f"steps[{index}].analysis", "must come after a weight or shadow step (before one, "
                                                         "the new version takes no traffic to measure)"))
        elif step.analysis is not None and any(c.name == DISAGREEMENT for c in step.analysis.checks) \
                and RolloutSpec(steps).shadow_at(index) is None:
            problems.append((f"steps[{index}].analysis.checks.{DISAGREEMENT}",
                             "needs a shadow step in force (one before it, with no weight step between): only "
                             "mirrored requests are answered by both versions"))
        elif step.pause and step.pause_s is None and not any(s.analysis for s in steps[index + 1:]):
            problems.append((f"steps[{index}].pause", "waits until resumed, but no analysis follows it: give it "
                                                      "a duration_s, or add an analysis after it"))


def _integer(data: Mapping[str, Any], name: str, default: int, low: int, high: int, path: str,
             problems: list[tuple[str, str]]) -> int:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        problems.append((f"{path}.{name}", f"must be an integer in [{low}, {high}], but got {brief(value)}"))
        return default
    return value


def _unknown(data: Mapping[str, Any], known: set[str], path: str, problems: list[tuple[str, str]]) -> None:
    for key in data:
        if key not in known:
            where = f"{path}.{key}" if path else str(key)
            problems.append((where, f"is not a field here (fields: {', '.join(sorted(known))})"))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
