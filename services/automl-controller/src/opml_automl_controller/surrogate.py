"""ServingConfigSurrogate trials: a model's serving latency or throughput over its serving
configuration, evaluated by the inference-router's performance model instead of by a job.

The trial template names a deployed model version, a pool kind and the serving options
(:data:`opml_common.perfmodel.OPTIONS`' configuration: batch, threads, optLevel, executionMode,
precision), each a fixed value or a ``${trialParameters.X}`` placeholder::

    trialSpec:
      apiVersion: jobs.opml.dev/v1
      kind: ServingConfigSurrogate
      spec:
        model: models/mlp/versions/1
        poolKind: accel
        config:
          batch: "${trialParameters.batch}"
          threads: "${trialParameters.threads}"
          optLevel: "${trialParameters.optLevel}"
          precision: int8

A trial asks the router's ``PredictServingPerformance`` for its one configuration and reports
``latency_ms`` (mean batch time) and ``throughput_rps`` (rows per second of one replica) as its
observation; the objective is one of them. No job runs, so nothing is cancelled or re-attached: a
trial asked before a restart and not told is predicted again (the same measurements give the same
prediction) and told once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from opml_automl_controller.experiment import Parameter, ParameterType, TrialTemplate, parameter_text
from opml_automl_controller.template import Violations, substitute
from opml_common.errors import InvalidArgument
from opml_common.perfmodel import ServingConfig
from opml_common.perfmodel.space import EXECUTION_MODES, OPT_LEVELS, PRECISIONS
from opml_inference_router_contract.client import DeploymentClient

METRICS = ("latency_ms", "throughput_rps")
"""What a surrogate trial reports: the objective and additional metrics must be among them."""
OPTIONS = {"batch": "batch", "threads": "threads", "optLevel": "opt_level", "executionMode": "execution_mode",
           "precision": "precision"}
"""The template's serving options (camelCase, as Kubernetes objects spell them) -> ServingConfig's."""
MAX_OPTION = 2**31 - 1
"""The largest integer option (batch, threads): the router's fields are int32."""
_CHOICES = {"opt_level": OPT_LEVELS, "execution_mode": EXECUTION_MODES, "precision": PRECISIONS}
_VERSION = re.compile(r"^models/[^/]+/versions/[1-9][0-9]*$")
_EXPANDED_INTS = 64  # an int parameter with at most this many values has each checked at admission


@dataclass(frozen=True, slots=True)
class SurrogateCall:
    """One trial's question to the router."""

    model_version: str
    pool_kind: str
    config: ServingConfig


class ServingPredictor(Protocol):
    """The router's predictions (blocking; the controller calls it on a thread)."""

    def predict(self, call: SurrogateCall) -> dict[str, float]:
        """``latency_ms`` and ``throughput_rps`` of the call's configuration.

        Raises: the router's domain errors (NotFound, FailedPrecondition, InvalidArgument;
        Unavailable, which is retriable).
        """


class RouterPredictor:
    """:class:`ServingPredictor` over the inference-router's DeploymentService (the reader role)."""

    def __init__(self, target: str, *, token: str | None = None) -> None:
        self._client = DeploymentClient(target, token=token)

    def predict(self, call: SurrogateCall) -> dict[str, float]:
        reply = self._client.predict_serving_performance(call.model_version, call.pool_kind, [call.config])
        (prediction,) = reply.predictions
        return {"latency_ms": prediction.latency_ms, "throughput_rps": prediction.throughput_rps}

    async def aclose(self) -> None:
        self._client.close()


def build_surrogate_call(template: TrialTemplate, values: Mapping[str, str], *, trial_name: str, namespace: str,
                         path: str = "spec.trialTemplate.trialSpec") -> SurrogateCall:
    """The router call of one trial (``values``: parameter name -> value as text).

    Raises:
        InvalidArgument: every field missing, unknown or outside the serving space, with its path.
    """
    body = substitute(template, values, trial_name=trial_name, namespace=namespace)
    found: Violations = []
    spec = body.get("spec")
    if not isinstance(spec, Mapping):
        raise InvalidArgument(f"{path}.spec", "must be a mapping with model, poolKind and config")
    for key in sorted(set(spec) - {"model", "poolKind", "config"}):
        found.append((f"{path}.spec.{key}", "is not a field of ServingConfigSurrogate; use model, poolKind, config"))
    model = spec.get("model")
    if not isinstance(model, str) or not _VERSION.fullmatch(model):
        found.append((f"{path}.spec.model", f"must name a deployed model version as models/{{model}}/versions/"
                                            f"{{version}}, but got {model!r}"))
    kind = spec.get("poolKind")
    if not isinstance(kind, str) or not kind:
        found.append((f"{path}.spec.poolKind", f"is required: the pool kind to predict on, but got {kind!r}"))
    config = spec.get("config")
    values_of: dict[str, Any] = {}
    if not isinstance(config, Mapping) or "batch" not in config:
        found.append((f"{path}.spec.config", "must be a mapping of serving options with at least batch "
                                             f"({', '.join(OPTIONS)})"))
    else:
        for key, value in config.items():
            where = f"{path}.spec.config.{key}"
            option = OPTIONS.get(str(key))
            if option is None:
                found.append((where, f"is not a serving option; options: {', '.join(OPTIONS)}"))
            elif option in _CHOICES:
                if str(value) not in _CHOICES[option]:
                    found.append((where, f"must be one of {', '.join(_CHOICES[option])}, but got {value!r}"))
                else:
                    values_of[option] = str(value)
            else:
                number = _integer(value)
                if number is None or number < 1:
                    found.append((where, f"must be an integer >= 1, but got {value!r}"))
                elif number > MAX_OPTION:
                    found.append((where, f"must be at most {MAX_OPTION} (the router's int32), but got {value!r}"))
                else:
                    values_of[option] = number
    if found:
        raise InvalidArgument.of(found)
    return SurrogateCall(str(model), str(kind), ServingConfig(**values_of))


def check_surrogate(template: TrialTemplate, parameters: Sequence[Parameter], path: str) -> Violations:
    """Admission: every value each parameter can take (with the others at their first), mapped to a
    call, so an option a parameter could push outside the space is refused before any trial runs;
    a violation of an option that names a parameter says which value of it broke the rule."""
    base = {p.name: _candidates(p)[0] for p in parameters}
    found: dict[str, str] = {}
    for parameter in parameters:
        names = [p.name for p in template.parameters if p.reference == parameter.name]
        for value in _candidates(parameter):
            try:
                build_surrogate_call(template, {**base, parameter.name: value}, trial_name="trial",
                                     namespace="default", path=path)
                continue
            except InvalidArgument as error:
                violations = error.violations
            broke = False
            for where, rule in violations:
                said = _raw(template, where[len(path) + 1:])
                if any(f"${{trialParameters.{name}}}" in said for name in names):
                    found[where] = f"{rule} (parameter {parameter.name} = {value})"
                    broke = True
                else:
                    found.setdefault(where, rule)
            if broke:
                break  # one bad value per parameter says enough
    if not parameters:
        try:
            build_surrogate_call(template, {}, trial_name="trial", namespace="default", path=path)
        except InvalidArgument as error:
            return list(error.violations)
    return list(found.items())


def check_objective(metric: str, additional: Sequence[str]) -> Violations:
    found: Violations = []
    if metric not in METRICS:
        found.append(("spec.objective.objectiveMetricName", f"a ServingConfigSurrogate trial reports "
                                                            f"{', '.join(METRICS)}, not {metric!r}"))
    for index, name in enumerate(additional):
        if name not in METRICS:
            found.append((f"spec.objective.additionalMetricNames[{index}]",
                          f"a ServingConfigSurrogate trial reports {', '.join(METRICS)}, not {name!r}"))
    return found


def _candidates(parameter: Parameter) -> list[str]:
    """The values of ``parameter`` as the controller writes them into a template (see controller._text)."""
    if parameter.type in (ParameterType.CATEGORICAL, ParameterType.DISCRETE):
        return [parameter_text(choice) for choice in parameter.choices]
    low, high = parameter.low, parameter.high
    assert low is not None and high is not None
    if parameter.type is ParameterType.INT:
        step = int(parameter.step or 1)
        if (high - low) / step < _EXPANDED_INTS:
            return [str(v) for v in range(int(low), int(high) + 1, step)]
        return [str(int(low)), str(int(high))]
    # a double draws any value between: one that is not whole shows whether an integer option takes it
    return [parameter_text(float(low)), parameter_text(float(high)), *(
        [parameter_text(low + 0.5)] if low + 0.5 <= high and float(low).is_integer() else [])]


def _raw(template: TrialTemplate, dotted: str) -> str:
    """The template's text at a dotted path (empty where there is none)."""
    node: Any = template.spec
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, Mapping) else None
    return "" if node is None else str(node)


def _integer(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    text = str(value).strip()  # discrete choices come as numbers: "4.0" is 4
    return int(text.partition(".")[0]) if re.fullmatch(r"-?[0-9]+(\.0*)?", text) else None
