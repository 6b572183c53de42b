"""The experiment's ``spec.model`` section: whether the best trial's model is committed, and how it is served.

An extension of Katib's Experiment (Katib keeps models out of its API)::

    spec:
      model:
        commit: true          # default true: the best trial's uploaded model becomes {experiment}-best
        serve: true           # tag it serve=true: the inference-router deploys it when it is committed
        canary: 10            # or a whole progressive rollout (the router's rollout.yaml), not both
        rollout: {steps: [{weight: 10}, {analysis: {interval_s: 30, checks: {error_rate: {max_increase: 0.01}}}}]}
        monitoring: {window: {count: 1000}, rules: [{name: accuracy-low, signal: mpp, under: 0.85}]}
        maxBytes: 1Gi         # the most one trial may upload (its upload grant's bound); default 1Gi

Each trial of such an experiment gets an upload grant for its own bundle (:mod:`.models`) and uploads
its model itself (:func:`opml_automl_controller.sdk.save_model`). The rollout is checked with the
inference-router's own rules (:class:`~opml_inference_router_contract.rollout_spec.RolloutSpec`); the
monitoring rules are the monitoring-scorer's ``monitoring.yaml`` (its top-level shape is checked here,
every field by the scorer when it registers the model). Every mistake is reported at once, each under
its path (``spec.model.rollout.steps[1].analysis.interval_s``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from opml_common.errors import InvalidArgument
from opml_inference_router_contract.rollout_spec import RolloutSpec

DEFAULT_MAX_BYTES = 1024**3
MAX_MAX_BYTES = 4 * 1024**3
"""The largest upload an experiment may allow a trial (the bundle-store's own bound by default)."""
MONITORING_KEYS = frozenset({"task", "features", "outputs", "window", "drift", "rules", "labels"})
"""The top-level fields of the monitoring-scorer's ``monitoring.yaml``."""
_KEYS = frozenset({"commit", "serve", "canary", "rollout", "monitoring", "maxBytes"})
_SIZE = re.compile(r"(\d+)\s*(Ki|Mi|Gi)?")
_UNITS = {None: 1, "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3}


@dataclass(frozen=True, slots=True)
class ModelPolicy:
    """What the experiment asks of its model. ``rollout_yaml`` and ``monitoring_yaml`` are the files
    the committed bundle carries (``rollout.yaml``, ``monitoring.yaml``), '' when not given."""

    commit: bool = True
    serve: bool = False
    canary: float | None = None
    rollout_yaml: str = ""
    monitoring_yaml: str = ""
    max_bytes: int = DEFAULT_MAX_BYTES

    def tags(self) -> dict[str, str]:
        """The serving tags of the committed bundle (the inference-router's autodeploy reads them)."""
        tags = {"serve": "true"} if self.serve else {}
        if self.canary is not None:
            tags["canary"] = f"{self.canary:g}"
        return tags


def parse_model_policy(value: Any, found: list[tuple[str, str]], *, path: str = "spec.model") -> ModelPolicy | None:
    """The section's policy (None: no section, or a mistake, each added to ``found``)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        found.append((path, f"must be a mapping, but got {type(value).__name__}"))
        return None
    before = len(found)
    found.extend((f"{path}.{key}", f"is not a known field; expected one of {sorted(_KEYS)}")
                 for key in value if key not in _KEYS)
    commit, serve = _flag(value, "commit", True, path, found), _flag(value, "serve", False, path, found)
    canary = value.get("canary")
    if canary is not None and (isinstance(canary, bool) or not isinstance(canary, int | float)
                               or not math.isfinite(canary) or not 0 < canary < 100):
        found.append((f"{path}.canary", f"must be a percentage of traffic in (0, 100), but got {canary!r}"))
    rollout_yaml = ""
    if value.get("rollout") is not None:
        try:
            rollout_yaml = yaml.safe_dump(RolloutSpec.from_dict(value["rollout"]).to_dict(), sort_keys=False)
        except InvalidArgument as error:
            found.extend((f"{path}.rollout.{field}" if field else f"{path}.rollout", rule)
                         for field, rule in error.violations)
    if canary is not None and value.get("rollout") is not None:
        found.append((f"{path}.canary", "cannot be combined with rollout: a canary is a rollout of one weight step"))
    if (canary is not None or value.get("rollout") is not None) and serve is False:
        found.append((f"{path}.serve", "must be true for a canary or a rollout (they say how it is served)"))
    if serve and commit is False:
        found.append((f"{path}.commit", "must be true to serve the model (only a committed bundle is deployed)"))
    monitoring_yaml = ""
    monitoring = value.get("monitoring")
    if monitoring is not None:
        if not isinstance(monitoring, Mapping):
            found.append((f"{path}.monitoring", f"must be a mapping (monitoring.yaml), but got "
                                                f"{type(monitoring).__name__}"))
        else:
            found.extend((f"{path}.monitoring.{key}", f"is not a field of monitoring.yaml; expected one of "
                                                      f"{sorted(MONITORING_KEYS)}")
                         for key in monitoring if key not in MONITORING_KEYS)
            monitoring_yaml = yaml.safe_dump(dict(monitoring), sort_keys=False)
    max_bytes = _size(value.get("maxBytes", DEFAULT_MAX_BYTES), f"{path}.maxBytes", found)
    if len(found) > before:
        return None
    return ModelPolicy(commit=bool(commit), serve=bool(serve), canary=float(canary) if canary is not None else None,
                       rollout_yaml=rollout_yaml, monitoring_yaml=monitoring_yaml, max_bytes=max_bytes)


def _flag(value: Mapping[str, Any], key: str, default: bool, path: str, found: list[tuple[str, str]]) -> bool | None:
    flag = value.get(key, default)
    if not isinstance(flag, bool):
        found.append((f"{path}.{key}", f"must be true or false, but got {flag!r}"))
        return None
    return flag


def _size(value: Any, path: str, found: list[tuple[str, str]]) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (match := _SIZE.fullmatch(value.strip())):
        size = int(match[1]) * _UNITS[match[2]]
    else:
        found.append((path, f"must be a number of bytes or a size (512Mi, 1Gi), but got {value!r}"))
        return DEFAULT_MAX_BYTES
    if not 1 <= size <= MAX_MAX_BYTES:
        found.append((path, f"must be between 1 byte and {MAX_MAX_BYTES} bytes (4Gi), but got {size}"))
    return size
