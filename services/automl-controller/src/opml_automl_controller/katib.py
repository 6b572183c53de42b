"""Katib v1beta1 Experiment YAML -> :class:`~opml_automl_controller.experiment.ExperimentSpec`.

A Katib user brings the Experiment they already have. :func:`parse_experiment` applies the rules
of Katib's admission webhook (pkg/webhook/v1beta1/experiment/validator), the later checks of its
suggestion services (ValidateAlgorithmSettings of the Optuna, goptuna, hyperopt, skopt and
hyperband services), and what this controller cannot run (NAS algorithms, trial kinds with no
executor here, collectors that need a sidecar), then Katib's defaults. Like Katib it collects
every violation rather than stopping at the first, and reports each with its YAML path:
``spec.parallelTrialCount: must not exceed spec.maxTrialCount (got 20 > 12)``.

One Katib early return is dropped: an invalid objective does not stop the other checks (a user
fixes every mistake in one pass). Trial-template checks that need the previous one to pass still
stop there (rules 19, 20, 26). Beyond Katib: a field Katib does not know is a warning (Katib's CRD
keeps unknown fields and ignores them, so a misspelt ``paralelTrialCount`` would run with the
default), and a ``${...}`` the trial's substitution leaves unresolved is refused with its field.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opml_automl_controller.experiment import (
    Algorithm,
    CollectorKind,
    Distribution,
    ExperimentSpec,
    Goal,
    MetricsCollector,
    Objective,
    Parameter,
    ParameterType,
    ResumePolicy,
    TrialParameter,
    TrialTemplate,
)
from opml_automl_controller.modelspec import parse_model_policy
from opml_automl_controller.surrogate import check_objective, check_surrogate
from opml_automl_controller.template import SURROGATE_KIND, check_template
from opml_common.errors import InvalidArgument
from opml_common.yamlsafe import load_yaml

MAX_EXPERIMENT_BYTES = 256 * 1024
"""The largest Experiment YAML accepted (Katib's are a few KiB; etcd's object limit is 1.5 MiB)."""

KATIB_ALGORITHMS = ("random", "tpe", "grid", "hyperband", "bayesianoptimization", "cmaes", "sobol",
                    "multivariate-tpe", "enas", "darts", "pbt")
"""katib-config's suggestion list (rule 13): a name outside it is unknown to Katib itself."""

SUPPORTED_ALGORITHMS = ("random", "grid", "tpe", "multivariate-tpe", "cmaes", "sobol", "bayesianoptimization",
                        "hyperband")
"""What this controller runs, each on an Optuna sampler (or pruner, for hyperband)."""

ALGORITHM_SETTINGS: dict[str, dict[str, str]] = {
    "random": {"random_state": "seed"},
    "grid": {"random_state": "seed"},
    "tpe": {"random_state": "seed", "n_startup_trials": "int>=0", "n_EI_candidates": "int>0",
            "n_ei_candidates": "int>0", "gamma": "float(0,1)", "prior_weight": "float>0"},
    "multivariate-tpe": {"random_state": "seed", "n_startup_trials": "int>=0", "n_ei_candidates": "int>0",
                         "n_EI_candidates": "int>0"},
    "cmaes": {"random_state": "seed", "sigma": "float>0", "restart_strategy": "ipop|none"},
    "sobol": {"random_state": "seed"},
    "bayesianoptimization": {"random_state": "seed", "n_initial_points": "int>=0"},
    "hyperband": {"resource_name": "str", "eta": "int>1", "r_l": "int>0"},
}
"""The algorithmSettings each algorithm takes (Katib's names) and the rule its value follows."""

MAX_SEED = 2**32 - 1
"""The largest random_state: Optuna's samplers seed numpy, whose seeds are 32-bit."""
MAX_SETTING_INT = 2**63 - 1
"""The largest integer setting (Katib's suggestion services parse them as Go's 64-bit ints)."""

OPTIONAL_ALGORITHMS = {"bayesianoptimization": ("torch", "PyTorch", "gp")}
"""Algorithms whose sampler needs a package of an optional extra: (its module, its name, the extra).
Optuna's GPSampler runs on PyTorch, a large install only those who ask for the algorithm get."""

UNMAPPED_SETTINGS = {
    "bayesianoptimization": ("base_estimator", "acq_func", "acq_optimizer"),
}
"""Katib settings of scikit-optimize that Optuna's GPSampler has no counterpart for."""

EARLY_STOPPING = {"medianstop": {"min_trials_required": "int>0", "start_step": "int>=1"}}
SUPPORTED_COLLECTORS = ("StdOut", "File", "Push", "Trace")
KATIB_COLLECTORS = ("StdOut", "File", "TensorFlowEvent", "PrometheusMetric", "Custom", "Push")
PARAMETER_TYPES = ("int", "double", "categorical", "discrete", "unknown")
DISTRIBUTIONS = ("uniform", "logUniform", "normal", "logNormal", "unknown")
MAX_GRID_COMBINATIONS = 10_000
"""The most combinations a grid experiment may have (Optuna's GridSampler lists them all; each
trial stores every parameter's grid as its distribution)."""
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # whole names only (Katib's MatchString checks a prefix)
_TWO_GROUPS = re.compile(r".*\(.*\).*\(.*\).*")

Violations = list[tuple[str, str]]


@dataclass(frozen=True)
class CheckedExperiment:
    """An experiment that passed every rule, and what it holds that is ignored (unknown fields)."""

    spec: ExperimentSpec
    warnings: tuple[str, ...]


def parse_experiment(source: str | bytes | Mapping[str, Any], *, what: str = "experiment",
                     runnable_here: bool = False) -> ExperimentSpec:
    """Check a Katib Experiment and return it with Katib's defaults applied (see :func:`check_experiment`)."""
    return check_experiment(source, what=what, runnable_here=runnable_here).spec


def check_experiment(source: str | bytes | Mapping[str, Any], *, what: str = "experiment",
                     runnable_here: bool = False) -> CheckedExperiment:
    """Check a Katib Experiment: its spec with Katib's defaults applied, and a warning per unknown field.

    Args:
        source: the YAML (one document), or the mapping it loads to.
        what: where the YAML came from (a file's path); a syntax error names it with line and column.
        runnable_here: also refuse an algorithm this process lacks the optional extra of
            (:data:`OPTIONAL_ALGORITHMS`): the controller's admission. A client checking a file before
            sending it, or a stored experiment read back, is not refused for what this install lacks.

    Raises:
        InvalidArgument: every rule the experiment breaks, one (YAML path, rule) violation each.
    """
    document = load_yaml(source, what=what, max_bytes=MAX_EXPERIMENT_BYTES) if not isinstance(source, Mapping) \
        else source
    spec, violations = _parse(document, runnable_here=runnable_here)
    if violations or spec is None:
        raise InvalidArgument.of(violations or [(what, "is not a Katib Experiment")])
    return CheckedExperiment(spec=spec, warnings=tuple(unknown_fields(document)))


def missing_extra(algorithm: str) -> str | None:
    """Why this process cannot run ``algorithm`` (the package of its extra is not installed), or None.
    The package is looked up, not imported: admission does not load PyTorch."""
    needs = OPTIONAL_ALGORITHMS.get(algorithm)
    if needs is None:
        return None
    module, package, extra = needs
    try:
        if importlib.util.find_spec(module) is not None:
            return None
    except (ImportError, ValueError):  # an import hook refused it; sys.modules holds None for it
        pass
    return f"algorithm {algorithm!r} needs {package}: install opml-automl-controller[{extra}]"


def _parse(doc: Any, *, runnable_here: bool = False) -> tuple[ExperimentSpec | None, Violations]:
    found: Violations = []
    if not isinstance(doc, Mapping):
        return None, [("experiment", f"must be a mapping (a Katib Experiment), but got {type(doc).__name__}")]
    if doc.get("kind", "Experiment") != "Experiment":
        found.append(("kind", f"must be Experiment, but got {doc.get('kind')!r}"))
    api = doc.get("apiVersion", "kubeflow.org/v1beta1")
    if api != "kubeflow.org/v1beta1":
        found.append(("apiVersion", f"must be kubeflow.org/v1beta1, but got {api!r}"))
    metadata = _mapping(doc.get("metadata"), "metadata", found)
    spec = _mapping(doc.get("spec"), "spec", found)
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        found.append(("metadata.name", "is required"))
    elif not _NAME.fullmatch(name) or len(name) > 40:
        found.append(("metadata.name", f"must match ^[a-z]([-a-z0-9]*[a-z0-9])?$ and be at most 40 characters "
                                       f"(got {name!r}, {len(name)} characters)"))
    namespace = metadata.get("namespace", "default")

    counts = _counts(spec, found)
    objective = _objective(spec, found)
    algorithm = _algorithm(spec.get("algorithm"), "spec.algorithm", found, early=False)
    if runnable_here and algorithm is not None and (missing := missing_extra(algorithm.name)):
        found.append(("spec.algorithm.algorithmName", missing))
    early = None
    if spec.get("earlyStopping") is not None:
        early = _algorithm(spec.get("earlyStopping"), "spec.earlyStopping", found, early=True)
    resume = spec.get("resumePolicy") or "Never"
    if resume not in ("Never", "LongRunning", "FromVolume"):
        found.append(("spec.resumePolicy", f"must be one of Never, LongRunning, FromVolume, but got {resume!r}"))
    parameters = _parameters(spec, found)
    template = _trial_template(spec, parameters, found)
    collector = _collector(spec.get("metricsCollectorSpec"), found)
    model = parse_model_policy(spec.get("model"), found)
    if algorithm is not None and parameters is not None:
        _algorithm_checks(algorithm, parameters, counts, found)
    if early is not None and algorithm is not None and algorithm.name == "hyperband":
        found.append(("spec.earlyStopping", "cannot be combined with algorithm hyperband: hyperband stops trials "
                                            "itself (one Optuna pruner per study)"))
    if _is_surrogate(spec) and objective is not None:
        found.extend(check_objective(objective.metric, objective.additional_metrics))
        if spec.get("metricsCollectorSpec") is not None:
            found.append(("spec.metricsCollectorSpec", "must not be set: a ServingConfigSurrogate trial runs no job; "
                                                       "its metrics come from the inference-router's prediction"))
        if spec.get("model") is not None:
            found.append(("spec.model", "must not be set: a ServingConfigSurrogate trial runs no job, so it "
                                        "trains no model"))
    if found or objective is None or algorithm is None or parameters is None or template is None \
            or collector is None:
        return None, found
    max_trials, parallel, max_failed = counts
    assert isinstance(name, str) and max_trials is not None
    return ExperimentSpec(
        name=name, namespace=str(namespace), objective=objective, algorithm=algorithm, parameters=tuple(parameters),
        trial_template=template, max_trial_count=max_trials, parallel_trial_count=parallel or 3,
        max_failed_trial_count=max_failed, early_stopping=early, collector=collector,
        resume_policy=ResumePolicy(resume), model=model), found


def _mapping(value: Any, path: str, found: Violations) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        found.append((path, f"must be a mapping, but got {type(value).__name__}"))
        return {}
    return value


def _int(value: Any, path: str, found: Violations) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        found.append((path, f"must be an integer, but got {value!r}"))
        return None
    return value


def _counts(spec: Mapping[str, Any], found: Violations) -> tuple[int | None, int | None, int | None]:
    """Rules 2-6. Katib defaults parallelTrialCount to 3; maxTrialCount is required here (Katib
    runs forever without it, which a controller that counts trials to the end cannot)."""
    max_trials = _int(spec.get("maxTrialCount"), "spec.maxTrialCount", found)
    parallel = _int(spec.get("parallelTrialCount", 3), "spec.parallelTrialCount", found)
    max_failed = _int(spec.get("maxFailedTrialCount"), "spec.maxFailedTrialCount", found)
    if max_failed is not None and max_failed < 0:
        found.append(("spec.maxFailedTrialCount", f"must be >= 0 (got {max_failed})"))
    if "maxTrialCount" not in spec:
        found.append(("spec.maxTrialCount", "is required (this controller runs an experiment to a trial budget)"))
    elif max_trials is not None and max_trials <= 0:
        found.append(("spec.maxTrialCount", f"must be greater than 0 (got {max_trials})"))
    if parallel is not None and parallel <= 0:
        found.append(("spec.parallelTrialCount", f"must be greater than 0 (got {parallel})"))
    if max_trials is not None and max_trials > 0:
        if max_failed is not None and max_failed > max_trials:
            found.append(("spec.maxFailedTrialCount",
                          f"must not exceed spec.maxTrialCount (got {max_failed} > {max_trials})"))
        if parallel is not None and parallel > max_trials:
            found.append(("spec.parallelTrialCount",
                          f"must not exceed spec.maxTrialCount (got {parallel} > {max_trials})"))
    return max_trials, parallel, max_failed


def _objective(spec: Mapping[str, Any], found: Violations) -> Objective | None:
    """Rules 8-11, plus metricStrategies (min, max or latest; defaulted from the objective's type)."""
    if spec.get("objective") is None:
        found.append(("spec.objective", "is required"))
        return None
    objective = _mapping(spec["objective"], "spec.objective", found)
    start = len(found)
    kind = objective.get("type")
    if kind not in ("minimize", "maximize"):
        found.append(("spec.objective.type", f"must be minimize or maximize, but got {kind!r}"))
    metric = objective.get("objectiveMetricName")
    if not isinstance(metric, str) or not metric:
        found.append(("spec.objective.objectiveMetricName", "is required"))
    additional = objective.get("additionalMetricNames") or []
    if not isinstance(additional, list) or not all(isinstance(m, str) and m for m in additional):
        found.append(("spec.objective.additionalMetricNames", "must be a list of metric names"))
        additional = []
    elif metric in additional:
        found.append(("spec.objective.additionalMetricNames",
                      f"must not contain the objectiveMetricName {metric!r}"))
    target = objective.get("goal")
    if target is not None and (isinstance(target, bool) or not isinstance(target, int | float)
                               or not math.isfinite(target)):
        found.append(("spec.objective.goal", f"must be a number, but got {target!r}"))
    strategies = []
    for i, item in enumerate(objective.get("metricStrategies") or []):
        path = f"spec.objective.metricStrategies[{i}]"
        item = _mapping(item, path, found)
        if item.get("name") not in [metric, *additional]:
            found.append((f"{path}.name", f"must be the objective or an additional metric, but got "
                                          f"{item.get('name')!r}"))
        if item.get("value") not in ("min", "max", "latest"):
            found.append((f"{path}.value", f"must be min, max or latest, but got {item.get('value')!r}"))
        strategies.append((str(item.get("name")), str(item.get("value"))))
    if len(found) > start:
        return None
    assert isinstance(metric, str)
    return Objective(goal=Goal(kind), metric=metric, target=float(target) if target is not None else None,
                     additional_metrics=tuple(additional), strategies=tuple(strategies))


def _algorithm(value: Any, path: str, found: Violations, *, early: bool) -> Algorithm | None:
    """Rules 12-14 and each algorithm's settings (the suggestion services' ValidateAlgorithmSettings)."""
    if value is None:
        found.append((path, "is required"))
        return None
    body = _mapping(value, path, found)
    name = body.get("algorithmName")
    if not isinstance(name, str) or not name:
        found.append((f"{path}.algorithmName", "is required"))
        return None
    supported = EARLY_STOPPING if early else ALGORITHM_SETTINGS
    if name not in supported:
        if early:
            found.append((f"{path}.algorithmName", f"unable to get EarlyStopping config data for algorithm "
                                                   f"{name!r}; supported: {sorted(EARLY_STOPPING)}"))
        elif name in KATIB_ALGORITHMS:
            found.append((f"{path}.algorithmName", f"algorithm {name!r} is not supported by this controller "
                                                   f"(it runs Optuna's samplers); supported: "
                                                   f"{', '.join(SUPPORTED_ALGORITHMS)}"))
        else:
            found.append((f"{path}.algorithmName", f"unable to get Suggestion config data for algorithm {name!r}; "
                                                   f"supported: {', '.join(SUPPORTED_ALGORITHMS)}"))
        return None
    rules = supported[name]
    settings: list[tuple[str, str]] = []
    for i, item in enumerate(body.get("algorithmSettings") or []):
        item_path = f"{path}.algorithmSettings[{i}]"
        item = _mapping(item, item_path, found)
        key, raw = item.get("name"), item.get("value")
        if not isinstance(key, str) or key not in rules:
            extra = ""
            if key in UNMAPPED_SETTINGS.get(name, ()):
                extra = " (a scikit-optimize setting Optuna's GPSampler has no counterpart for)"
            found.append((f"{item_path}.name", f"unknown setting {key!r} for algorithm {name}{extra}; "
                                               f"known: {sorted(rules)}"))
            continue
        text = str(raw) if raw is not None else ""
        problem = _setting_problem(rules[key], text)
        if problem:
            found.append((f"{item_path}.value", f"{key} {problem}, but got {text!r}"))
        settings.append((key, text))
    return Algorithm(name=name, settings=tuple(settings))


def _setting_problem(rule: str, text: str) -> str | None:
    if rule == "seed":
        problem = _setting_problem("int>=0", text)
        return problem or (None if int(text) <= MAX_SEED else f"must be at most {MAX_SEED} (numpy's 32-bit seeds)")
    if rule == "str":
        return None if text else "must be set"
    if "|" in rule:
        choices = rule.split("|")
        return None if text.lower() in choices else f"must be one of {choices}"
    kind, _, bound = rule.partition(">") if ">" in rule else rule.partition("(")
    try:
        number = int(text) if kind == "int" else float(text)
    except ValueError:
        return f"must be {'an integer' if kind == 'int' else 'a number'}"
    if kind == "int" and not -MAX_SETTING_INT - 1 <= number <= MAX_SETTING_INT:
        return f"must fit in 64 bits (at most {MAX_SETTING_INT})"
    if not math.isfinite(number):
        return "must be finite"
    if rule.endswith("(0,1)"):
        return None if 0 < number < 1 else "must be in (0, 1)"
    if bound.startswith("="):
        return None if number >= float(bound[1:]) else f"must be >= {bound[1:]}"
    return None if number > float(bound) else f"must be > {bound}"


def _number(value: Any, path: str, found: Violations) -> float | None:
    """Katib writes feasibleSpace bounds as strings ("0.01"); numbers are accepted too."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        found.append((path, f"must be a number, but got {value!r}"))
        return None
    if not math.isfinite(number):
        found.append((path, f"must be finite, but got {value!r}"))
        return None
    return number


def _as_written(literal: Any, number: float) -> int | float:
    """A discrete choice as the trial template gets it: "32" stays 32 (not "32.0", which an int flag refuses),
    as Katib passes the listed value through; "0.5" and "1.0" stay floats."""
    if isinstance(literal, bool) or not number.is_integer():
        return number
    if isinstance(literal, int) or (isinstance(literal, str) and not any(c in literal for c in ".eE")):
        return int(number)
    return number


def _parameters(spec: Mapping[str, Any], found: Violations) -> list[Parameter] | None:
    """Rules 32-37; goptuna's duplicate-name check; our choice on min > max and on normal/logNormal."""
    raw, nas = spec.get("parameters"), spec.get("nasConfig")
    if raw is None and nas is None:
        found.append(("spec.parameters", "is required (or spec.nasConfig)"))
        return None
    if raw is not None and nas is not None:
        found.append(("spec.nasConfig", "only one of spec.parameters and spec.nasConfig can be set"))
        return None
    if nas is not None:
        return []  # a NAS experiment: its algorithm (enas, darts) is reported as unsupported
    if not isinstance(raw, list):
        found.append(("spec.parameters", "must be a list"))
        return None
    parameters: list[Parameter] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        path = f"spec.parameters[{i}]"
        item = _mapping(item, path, found)
        name, kind = item.get("name"), item.get("parameterType")
        if not isinstance(name, str) or not name:
            found.append((f"{path}.name", "is required"))
            continue
        if name in seen:
            found.append((f"{path}.name", f"Detect duplicated parameter name {name!r} (goptuna, Optuna and the "
                                          f"Katib SDK need unique names)"))
        seen.add(name)
        if kind not in PARAMETER_TYPES:
            found.append((f"{path}.parameterType", f"parameterType {kind!r} is not supported; must be one of "
                                                   f"{', '.join(PARAMETER_TYPES)}"))
            continue
        space = item.get("feasibleSpace")
        if not space:
            found.append((f"{path}.feasibleSpace", "is required"))
            continue
        space = _mapping(space, f"{path}.feasibleSpace", found)
        distribution = space.get("distribution") or "uniform"
        if distribution not in DISTRIBUTIONS:
            found.append((f"{path}.feasibleSpace.distribution", f"must be one of {', '.join(DISTRIBUTIONS)}, "
                                                                f"but got {distribution!r}"))
            continue
        if distribution in ("normal", "logNormal"):
            found.append((f"{path}.feasibleSpace.distribution",
                          f"{distribution} is not supported: Optuna's samplers draw from uniform and log-uniform "
                          f"spaces only (Katib's Optuna suggestion service rejects it too); use uniform or "
                          f"logUniform"))
            continue
        if kind == "unknown":
            found.append((f"{path}.parameterType", "parameterType unknown cannot be sampled; must be int, double, "
                                                   "categorical or discrete"))
            continue
        if kind in ("int", "double"):
            if "list" in space:
                found.append((f"{path}.feasibleSpace.list", f"is not allowed for parameterType {kind}"))
            missing = [key for key in ("min", "max") if key not in space]
            for key in missing:
                found.append((f"{path}.feasibleSpace.{key}", f"is required for parameterType {kind}"))
            if missing:
                continue
            low = _number(space["min"], f"{path}.feasibleSpace.min", found)
            high = _number(space["max"], f"{path}.feasibleSpace.max", found)
            step = _number(space["step"], f"{path}.feasibleSpace.step", found) if "step" in space else None
            if low is None or high is None or ("step" in space and step is None):
                continue
            if kind == "int":
                for key, number in (("min", low), ("max", high), ("step", step)):
                    if number is not None and number != int(number):
                        found.append((f"{path}.feasibleSpace.{key}", f"must be an integer for parameterType int, "
                                                                     f"but got {space[key]!r}"))
            if low > high:  # not a Katib rule: Optuna's distributions raise for it, so say it here
                found.append((f"{path}.feasibleSpace", f"min must not exceed max (got {low:g} > {high:g})"))
            if step is not None and step <= 0:
                found.append((f"{path}.feasibleSpace.step", f"must be > 0, but got {space['step']!r}"))
            if distribution == "logUniform" and step is not None:
                found.append((f"{path}.feasibleSpace.step", "cannot be combined with distribution logUniform "
                                                            "(Optuna's log spaces have no step)"))
            if distribution == "logUniform" and low <= 0:
                found.append((f"{path}.feasibleSpace.min", f"must be > 0 for distribution logUniform (got {low:g})"))
            parameters.append(Parameter(name=name, type=ParameterType(kind), low=low, high=high, step=step,
                                        distribution=Distribution(distribution)))
        else:
            bad = [key for key in ("min", "max", "step") if key in space]
            for key in bad:
                found.append((f"{path}.feasibleSpace.{key}", f"is not allowed for parameterType {kind}"))
            choices = space.get("list")
            if not isinstance(choices, list) or not choices:
                found.append((f"{path}.feasibleSpace.list", f"is required for parameterType {kind}"))
                continue
            if kind == "discrete":
                numbers = [_number(c, f"{path}.feasibleSpace.list[{j}]", found) for j, c in enumerate(choices)]
                if any(n is None for n in numbers):
                    continue
                values: tuple[Any, ...] = tuple(_as_written(c, n) for c, n in zip(choices, numbers))
            else:
                values = tuple(str(c) for c in choices)
            if len(set(values)) != len(values):
                found.append((f"{path}.feasibleSpace.list", f"must not repeat a value, but got {choices!r}"))
            if not bad:
                parameters.append(Parameter(name=name, type=ParameterType(kind), choices=values))
    return parameters


def _is_surrogate(spec: Mapping[str, Any]) -> bool:
    """Whether the trial template is a ServingConfigSurrogate (read before it is checked)."""
    template = spec.get("trialTemplate")
    body = template.get("trialSpec") if isinstance(template, Mapping) else None
    return isinstance(body, Mapping) and f"{body.get('apiVersion')} {body.get('kind')}" == SURROGATE_KIND


def _trial_template(spec: Mapping[str, Any], parameters: list[Parameter] | None,
                    found: Violations) -> TrialTemplate | None:
    """Rules 16-31 (the webhook's validateTrialTemplate), then the kinds this controller runs."""
    base = "spec.trialTemplate"
    if spec.get("trialTemplate") is None:
        found.append((base, "is required"))
        return None
    template = _mapping(spec["trialTemplate"], base, found)
    start = len(found)
    primary = template.get("primaryContainerName")
    if (not isinstance(primary, str) or not primary) and not _is_surrogate(spec):  # a surrogate runs no container
        found.append((f"{base}.primaryContainerName", "is required"))
    trial_parameters = template.get("trialParameters")
    if trial_parameters is None:
        found.append((f"{base}.trialParameters", "is required"))
        return None
    has_spec, has_map = template.get("trialSpec") is not None, template.get("configMap") is not None
    if has_spec == has_map:
        found.append((base, "exactly one of trialSpec and configMap must be set"
                      + (" (both are)" if has_spec else " (neither is)")))
        return None
    if has_map:
        config_map = _mapping(template["configMap"], f"{base}.configMap", found)
        for key in ("configMapName", "configMapNamespace", "templatePath"):
            if not config_map.get(key):
                found.append((f"{base}.configMap.{key}", "is required"))
        found.append((f"{base}.configMap", "unable to parse spec.trialTemplate: a ConfigMap template is read from "
                                           "the Kubernetes API, which this controller does not read; put the "
                                           "template inline in trialSpec"))
        return None
    names: set[str] = set()
    references: set[str] = set()
    declared: list[TrialParameter] = []
    raw = spec.get("parameters") if isinstance(spec.get("parameters"), list) else []
    parameter_names = {p.get("name") for p in raw if isinstance(p, Mapping) and isinstance(p.get("name"), str)}
    if not isinstance(trial_parameters, list):
        found.append((f"{base}.trialParameters", "must be a list"))
        return None
    for i, item in enumerate(trial_parameters):
        path = f"{base}.trialParameters[{i}]"
        item = _mapping(item, path, found)
        name, reference = item.get("name"), item.get("reference")
        if not isinstance(name, str) or not name or not isinstance(reference, str) or not reference:
            found.append((path, "name and reference are required"))
            continue
        if "{" in name or "}" in name:
            found.append((f"{path}.name", f"must not contain '{{' or '}}', but got {name!r}"))
        if name in names:
            found.append((f"{path}.name", f"duplicate trialParameter name {name!r}"))
        if reference in references:
            found.append((f"{path}.reference", f"duplicate trialParameter reference {reference!r}"))
        names.add(name)
        references.add(reference)
        if parameter_names and reference not in parameter_names and not _is_metadata_reference(reference):
            found.append((f"{path}.reference", f"reference {reference!r} is not a parameter of spec.parameters "
                                               f"({sorted(parameter_names)}) nor trial metadata "
                                               f"(${{trialSpec.Name}}, ...)"))
        declared.append(TrialParameter(name=name, reference=reference))
    body = template["trialSpec"]
    if not isinstance(body, Mapping):
        found.append((f"{base}.trialSpec", "must be a mapping (a Kubernetes object)"))
        return None
    unresolved = unresolved_placeholders(body, declared, parameter_names, f"{base}.trialSpec")
    found.extend(unresolved)
    # an undeclared ${trialParameters.X} is reported above with its field, not again for the whole template
    found.extend(v for v in check_template(body, declared, f"{base}.trialSpec", str(primary or ""))
                 if not (unresolved and v[1].startswith("undeclared placeholder")))
    if len(found) > start:
        return None
    checked = TrialTemplate(api_version=str(body.get("apiVersion")), kind=str(body.get("kind")), spec=dict(body),
                            primary_container=str(primary), parameters=tuple(declared))
    if f"{checked.api_version} {checked.kind}" == SURROGATE_KIND:
        found.extend(check_surrogate(checked, parameters or [], f"{base}.trialSpec"))
        if len(found) > start:
            return None
    return checked


_OPENING = re.compile(r"\$\{([^}]*)(\}?)")
_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def unresolved_placeholders(body: Mapping[str, Any], declared: list[TrialParameter], parameter_names: set[Any],
                            path: str) -> Violations:
    """Every ``${...}`` in the template that a trial's substitution would leave as it is, with its field.

    Only ``${trialParameters.<declared name>}`` is substituted. An unclosed ``${``, a misspelt prefix
    (``${trialParameter.lr}``), a dotted name or a bare parameter name (``${lr}``) would reach the
    trial's command as literal text, so they are refused. Any other ``${NAME}`` is a shell variable of
    an ``sh -c`` script and is left alone.
    """
    names = {p.name for p in declared}
    bare = names | {n for n in parameter_names if isinstance(n, str)}
    found: Violations = []

    def walk(node: Any, where: str) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, f"{where}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}[{i}]")
        elif isinstance(node, str):
            for match in _OPENING.finditer(node):
                inner, closed = match.group(1), bool(match.group(2))
                written = match.group(0)
                if not closed:
                    found.append((where, f"unclosed placeholder {written!r}: write ${{trialParameters.<name>}}"))
                elif inner.startswith("trialParameters."):
                    if inner.removeprefix("trialParameters.") not in names:
                        found.append((where, f"undeclared placeholder {written}: declare it in "
                                             f"spec.trialTemplate.trialParameters (declared: {sorted(names)})"))
                elif inner in bare or not _SHELL_NAME.fullmatch(inner):
                    found.append((where, f"unresolved placeholder {written}: only ${{trialParameters.<name>}} is "
                                         f"substituted (declared: {sorted(names)})"))

    walk(body, path)
    return found


_KNOWN_FIELDS: dict[str, frozenset[str]] = {
    "": frozenset({"apiVersion", "kind", "metadata", "spec", "status"}),
    "metadata": frozenset({"name", "namespace", "labels", "annotations", "generateName", "uid", "resourceVersion",
                           "generation", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds",
                           "ownerReferences", "finalizers", "managedFields", "selfLink"}),
    "spec": frozenset({"parameters", "objective", "algorithm", "trialTemplate", "parallelTrialCount",
                       "maxTrialCount", "maxFailedTrialCount", "metricsCollectorSpec", "nasConfig", "resumePolicy",
                       "earlyStopping", "model"}),
    "spec.objective": frozenset({"type", "goal", "objectiveMetricName", "additionalMetricNames",
                                 "metricStrategies"}),
    "spec.objective.metricStrategies[]": frozenset({"name", "value"}),
    "spec.algorithm": frozenset({"algorithmName", "algorithmSettings"}),
    "spec.algorithm.algorithmSettings[]": frozenset({"name", "value"}),
    "spec.earlyStopping": frozenset({"algorithmName", "algorithmSettings"}),
    "spec.earlyStopping.algorithmSettings[]": frozenset({"name", "value"}),
    "spec.parameters[]": frozenset({"name", "parameterType", "feasibleSpace"}),
    "spec.parameters[].feasibleSpace": frozenset({"max", "min", "list", "step", "distribution"}),
    "spec.trialTemplate": frozenset({"retain", "trialSpec", "configMap", "trialParameters", "primaryPodLabels",
                                     "primaryContainerName", "successCondition", "failureCondition"}),
    "spec.trialTemplate.configMap": frozenset({"configMapName", "configMapNamespace", "templatePath"}),
    "spec.trialTemplate.trialParameters[]": frozenset({"name", "description", "reference"}),
    "spec.metricsCollectorSpec": frozenset({"source", "collector"}),
    "spec.metricsCollectorSpec.source": frozenset({"filter", "fileSystemPath", "httpGet"}),
    "spec.metricsCollectorSpec.source.filter": frozenset({"metricsFormat"}),
    "spec.metricsCollectorSpec.source.fileSystemPath": frozenset({"path", "kind", "format"}),
    "spec.metricsCollectorSpec.collector": frozenset({"kind", "customCollector"}),
}
"""The fields of Katib's v1beta1 Experiment types (and Kubernetes' ObjectMeta), by their place in the
document ("[]": each item of a list). The trial template and nasConfig are not listed: the template is
checked as the Kubernetes object it is (rule 31), and a NAS experiment is refused for its algorithm."""


def unknown_fields(document: Mapping[str, Any]) -> list[str]:
    """A warning for each field Katib's Experiment does not have (with the nearest known name)."""
    warnings: list[str] = []

    def walk(node: Any, shape: str, where: str) -> None:
        if isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{shape}[]", f"{where}[{i}]")
            return
        known = _KNOWN_FIELDS.get(shape)
        if known is None or not isinstance(node, Mapping):
            return
        for key, value in node.items():
            path = f"{where}.{key}" if where else str(key)
            if key not in known:
                near = difflib.get_close_matches(str(key), sorted(known), n=1)
                hint = f" (did you mean {near[0]}?)" if near else ""
                warnings.append(f"{path}: unknown field, ignored{hint}")
                continue
            walk(value, f"{shape}.{key}" if shape else str(key), path)

    walk(document, "", "")
    return warnings


_METADATA_REFERENCE = re.compile(r"^\$\{trialSpec\.(Name|Namespace|Kind|APIVersion|Labels\[[^\]]+\]|"
                                 r"Annotations\[[^\]]+\])\}$")


def _is_metadata_reference(reference: str) -> bool:
    return bool(_METADATA_REFERENCE.fullmatch(reference))


def _collector(value: Any, found: Violations) -> MetricsCollector | None:
    """Rules 38-44 (validateMetricsCollector) and the kinds this controller collects."""
    base = "spec.metricsCollectorSpec"
    if value is None:
        return MetricsCollector()
    body = _mapping(value, base, found)
    collector = _mapping(body.get("collector"), f"{base}.collector", found)
    source = _mapping(body.get("source"), f"{base}.source", found)
    kind = collector.get("kind") or "StdOut"
    start = len(found)
    filters = _mapping(source.get("filter"), f"{base}.source.filter", found).get("metricsFormat") or []
    for i, pattern in enumerate(filters):
        path = f"{base}.source.filter.metricsFormat[{i}]"
        try:
            compiled = re.compile(str(pattern))
        except re.error as error:
            found.append((path, f"must compile as a regular expression: {error}"))
            continue
        if not _TWO_GROUPS.match(str(pattern)) or compiled.groups < 2:
            found.append((path, f"must contain two top-level groups (name, value), but got {pattern!r}"))
    if kind not in KATIB_COLLECTORS and kind != "Trace":
        found.append((f"{base}.collector.kind", f"invalid metrics collector kind {kind!r}"))
        return None
    if kind not in SUPPORTED_COLLECTORS:
        why = {"TensorFlowEvent": "it reads TensorBoard event files from the trial's volume",
               "PrometheusMetric": "it scrapes the trial pod's HTTP endpoint",
               "Custom": "it runs the user's sidecar image"}[kind]
        found.append((f"{base}.collector.kind", f"metrics collector kind {kind} is not supported: {why}; supported: "
                                                f"{', '.join(SUPPORTED_COLLECTORS)}"))
        return None
    path_value, file_format = None, "TEXT"
    if kind == "Trace" and filters:
        found.append((f"{base}.source.filter", "must not be set with collector kind Trace (the metrics are the "
                                               "names of Keras's epoch logs, e.g. loss, accuracy, val_loss)"))
    if kind == "File":
        file_path = _mapping(source.get("fileSystemPath"), f"{base}.source.fileSystemPath", found)
        path_value = file_path.get("path")
        if not isinstance(path_value, str) or not path_value.startswith("/"):
            found.append((f"{base}.source.fileSystemPath.path", f"must be an absolute path, but got {path_value!r}"))
        if file_path.get("kind", "File") != "File":
            found.append((f"{base}.source.fileSystemPath.kind", f"must be File, but got {file_path.get('kind')!r}"))
        file_format = file_path.get("format") or "TEXT"
        if file_format not in ("TEXT", "JSON"):
            found.append((f"{base}.source.fileSystemPath.format", f"must be TEXT or JSON, but got {file_format!r}"))
        if file_format == "JSON" and filters:
            found.append((f"{base}.source.filter", "must not be set with format JSON"))
    if len(found) > start:
        return None
    return MetricsCollector(kind=CollectorKind(kind), filters=tuple(str(f) for f in filters), path=path_value,
                            file_format=file_format)


def _algorithm_checks(algorithm: Algorithm, parameters: list[Parameter],
                      counts: tuple[int | None, int | None, int | None], found: Violations) -> None:
    """The suggestion services' checks that look at the whole experiment."""
    max_trials, parallel, _ = counts
    numeric = [p for p in parameters if p.type in (ParameterType.INT, ParameterType.DOUBLE)]
    if algorithm.name == "cmaes" and len(numeric) < 2:
        found.append(("spec.parameters", f"algorithm cmaes needs at least 2 int or double parameters "
                                         f"(got {len(numeric)})"))
    if algorithm.name == "grid":
        _grid_checks(parameters, max_trials, found)
    if algorithm.name == "hyperband":
        resource, eta, r_l = (algorithm.setting(k) for k in ("resource_name", "eta", "r_l"))
        for key, value in (("resource_name", resource), ("r_l", r_l)):
            if value is None:
                found.append(("spec.algorithm.algorithmSettings", f"hyperband needs the setting {key}"))
        if resource is not None and resource not in {p.name for p in parameters}:
            found.append(("spec.algorithm.algorithmSettings", f"resource_name {resource!r} must be one of "
                                                              f"spec.parameters"))
        elif resource is not None and next(p for p in parameters if p.name == resource).type is not ParameterType.INT:
            found.append(("spec.algorithm.algorithmSettings", f"resource_name {resource!r} must be an int "
                                                              f"parameter (a number of epochs or steps)"))
        try:
            need = hyperband_bracket_size(float(r_l or 0), int(eta or 3))
        except (ValueError, ZeroDivisionError, OverflowError):  # a bad r_l or eta is reported with its setting
            need = None
        if need is not None and parallel is not None and parallel < need:
            found.append(("spec.parallelTrialCount", f"must be at least hyperband's bracket size (got {parallel} "
                                                     f"< {need}, from r_l and eta)"))


def _grid_checks(parameters: list[Parameter], max_trials: int | None, found: Violations) -> None:
    """Every numeric parameter needs a step, and the grid is counted, not listed: Optuna's GridSampler
    lists every combination, so a grid past :data:`MAX_GRID_COMBINATIONS` is refused here."""
    missing = [i for i, p in enumerate(parameters) if p.type in (ParameterType.INT, ParameterType.DOUBLE)
               and p.step is None]
    for i in missing:
        found.append((f"spec.parameters[{i}].feasibleSpace.step",
                      "For discrete search space, all parameters must include step (algorithm grid)"))
    if missing or any(not p.choices and (p.step <= 0 or p.low > p.high) for p in parameters):
        return  # a bad step or range is reported with its parameter
    combinations = 1
    for i, p in enumerate(parameters):
        size = grid_size(p)
        combinations *= size
        if combinations > MAX_GRID_COMBINATIONS:
            found.append((f"spec.parameters[{i}].feasibleSpace", f"grid over {p.name} ({size:g} values) makes more "
                                                                 f"than {MAX_GRID_COMBINATIONS} combinations; use "
                                                                 f"a larger step or fewer values"))
            return
    if max_trials is not None and max_trials > combinations:
        found.append(("spec.maxTrialCount", f"must not exceed the number of grid combinations "
                                            f"(got {max_trials} > {combinations})"))


def hyperband_bracket_size(r_l: float, eta: int) -> int:
    """Trials in hyperband's largest bracket, as Katib's hyperband service computes it."""
    if r_l <= 0 or eta <= 1:
        raise ValueError("r_l must be > 0 and eta > 1")
    s_max = int(math.log(r_l) / math.log(eta) + 1e-9)
    budget = (s_max + 1) * r_l
    return int(math.ceil(int(budget / r_l / (s_max + 1)) * eta ** s_max))


def grid_size(parameter: Parameter) -> float:
    """How many values :func:`grid_values` gives, counted without listing them (inf past a float's range)."""
    if parameter.choices:
        return len(parameter.choices)
    assert parameter.low is not None and parameter.high is not None and parameter.step is not None
    steps = (parameter.high - parameter.low) / parameter.step + 1e-9
    return math.floor(steps) + 1 if math.isfinite(steps) else math.inf


def grid_values(parameter: Parameter) -> list[Any]:
    """Every value a grid visits: min to max by step (max included when on the grid), or the list."""
    if parameter.choices:
        return list(parameter.choices)
    assert parameter.low is not None and parameter.step is not None
    values = [parameter.low + k * parameter.step for k in range(int(grid_size(parameter)))]
    if parameter.type is ParameterType.INT:
        return [int(round(v)) for v in values]
    return [round(v, 12) for v in values]
