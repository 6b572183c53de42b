"""The rollout spec a bundle may carry beside ``model.yaml`` (``rollout.yaml``): how a new version of
the model takes traffic from the stable one, step by step, with analyses that decide on the way.

It is a file of its own, not a section of ``model.yaml``: the model config says what a model needs to
be served (workers read it too), the rollout says how one delivery of it proceeds; the same model can
be delivered with another rollout without changing its config. Producers validate it here, with the
router's rules, through :func:`load_rollout_spec` / :meth:`RolloutSpec.from_dict`.

Example::

    steps:
      - weight: 10                # 10% of the model's traffic to the new version
      - analysis:                 # measured over each interval, new version against stable
          interval_s: 30
          count: 4                # measurements; all must pass (within the limits) to go on
          failure_limit: 0        # more failed measurements than this: abort (back to stable)
          inconclusive_limit: 1   # more inconclusive ones than this: pause, saying why
          checks:
            error_rate: {max_increase: 0.01, min_requests: 100}
            p99_latency: {max_ratio: 1.5, min_requests: 100}
      - pause: {duration_s: 60}   # or {} : until resumed
      - weight: 50
      - analysis: {interval_s: 30, count: 4, checks: {error_rate: {max_increase: 0.01}}}

After the last step the new version is promoted. Checks compare the new version with the stable one
over the same interval, from the router's own measures: ``error_rate`` (failed / all requests; passes
when new - stable <= ``max_increase``) and ``p99_latency`` (passes when new / stable <= ``max_ratio``).
Fewer than ``min_requests`` requests to either version in an interval make that check inconclusive.

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
from opml_inference_router_contract.model_config import read_document

ROLLOUT_FILE = "rollout.yaml"
"""Where a bundle carries its rollout spec (beside ``model.yaml``)."""

ERROR_RATE, P99_LATENCY = "error_rate", "p99_latency"
CHECKS = (ERROR_RATE, P99_LATENCY)
"""The checks an analysis may run."""

MAX_STEPS = 64
MAX_INTERVAL_S = 24 * 3600.0
MAX_COUNT = 10_000
DEFAULT_MIN_REQUESTS = 50


@dataclass(frozen=True)
class Check:
    """One comparison of the new version with the stable one; ``bound`` is ``max_increase`` for
    error_rate (an absolute rate difference), ``max_ratio`` for p99_latency."""

    name: str
    bound: float
    min_requests: int = DEFAULT_MIN_REQUESTS


@dataclass(frozen=True)
class Analysis:
    interval_s: float
    count: int = 1
    failure_limit: int = 0
    inconclusive_limit: int = 0
    checks: tuple[Check, ...] = ()


@dataclass(frozen=True)
class Step:
    """Exactly one of: ``weight`` (percent of traffic to the new version), ``pause`` (``pause_s``
    seconds, or None: until resumed), ``analysis``."""

    weight: float | None = None
    pause: bool = False
    pause_s: float | None = None
    analysis: Analysis | None = None

    @property
    def kind(self) -> str:
        return "weight" if self.weight is not None else "pause" if self.pause else "analysis"


@dataclass(frozen=True)
class RolloutSpec:
    steps: tuple[Step, ...] = field(default_factory=tuple)

    @classmethod
    def from_dict(cls, data: Any) -> RolloutSpec:
        """Raises: InvalidArgument with one violation per bad field."""
        problems: list[tuple[str, str]] = []
        spec = _spec(data, problems)
        if problems:
            raise InvalidArgument.of(problems)
        return spec

    def to_dict(self) -> dict[str, Any]:
        """The spec as :meth:`from_dict` reads it (what the control plane stores)."""
        steps: list[dict[str, Any]] = []
        for step in self.steps:
            if step.weight is not None:
                steps.append({"weight": step.weight})
            elif step.pause:
                steps.append({"pause": {} if step.pause_s is None else {"duration_s": step.pause_s}})
            elif step.analysis is not None:
                a = step.analysis
                checks = {c.name: {_BOUNDS[c.name]: c.bound, "min_requests": c.min_requests} for c in a.checks}
                steps.append({"analysis": {"interval_s": a.interval_s, "count": a.count,
                                           "failure_limit": a.failure_limit,
                                           "inconclusive_limit": a.inconclusive_limit, "checks": checks}})
        return {"steps": steps}


def load_rollout_spec(path: str | Path) -> RolloutSpec:
    """Reads a rollout spec from a YAML or JSON file.

    Raises: NotFound (no file), InvalidArgument (not YAML/JSON, or fields break rules: all named).
    """
    return RolloutSpec.from_dict(read_document(Path(path)))


# ----------------------------------------------------------------------------------------------

_BOUNDS = {ERROR_RATE: "max_increase", P99_LATENCY: "max_ratio"}


def _spec(data: Any, problems: list[tuple[str, str]]) -> RolloutSpec:
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
    steps = tuple(_step(item, f"steps[{index}]", problems) for index, item in enumerate(raw))
    _order(steps, problems)
    return RolloutSpec(steps)


def _step(data: Any, path: str, problems: list[tuple[str, str]]) -> Step:
    if not isinstance(data, Mapping) or len(data) != 1 or next(iter(data)) not in ("weight", "pause", "analysis"):
        problems.append((path, f"must be one of {{weight: PCT}}, {{pause: {{...}}}}, {{analysis: {{...}}}}, "
                               f"but got {brief(data)}"))
        return Step(pause=True, pause_s=0.0)
    kind, value = next(iter(data.items()))
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
    if not isinstance(data, Mapping):
        problems.append((path, f"must be a mapping with {_BOUNDS[name]}, but got {brief(data)}"))
        return None
    bound_name = _BOUNDS[name]
    _unknown(data, {bound_name, "min_requests"}, path, problems)
    bound = data.get(bound_name)
    if name == ERROR_RATE and (not _number(bound) or not 0 <= bound <= 1):
        problems.append((f"{path}.{bound_name}", f"must be a rate difference in [0, 1], but got {brief(bound)}"))
    elif name == P99_LATENCY and (not _number(bound) or not 1 <= bound <= 1000):
        problems.append((f"{path}.{bound_name}", f"must be a ratio in [1, 1000], but got {brief(bound)}"))
    minimum = _integer(data, "min_requests", DEFAULT_MIN_REQUESTS, 1, 10**9, path, problems)
    return Check(name, float(bound) if _number(bound) else 0.0, minimum)


def _order(steps: tuple[Step, ...], problems: list[tuple[str, str]]) -> None:
    """Rules across steps: an analysis measures the new version, so one must take traffic before it;
    a pause until resumed must be followed by an analysis (else it is a manual canary: deploy with
    ``canary`` instead)."""
    weighted = False
    for index, step in enumerate(steps):
        if step.weight is not None:
            weighted = True
        elif step.analysis is not None and not weighted:
            problems.append((f"steps[{index}].analysis", "must come after a weight step (before one, the new "
                                                         "version takes no traffic to measure)"))
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
