"""The controller's view of an experiment: what a Katib Experiment says, checked and defaulted.

:mod:`opml_automl_controller.katib` builds these from the YAML; the controller, the algorithms
and the metrics collectors read them. Frozen: an experiment's spec does not change once created,
except its three counts (``replace`` on resume, as Katib allows).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from opml_automl_controller.modelspec import ModelPolicy


class Goal(enum.Enum):
    MINIMIZE = "minimize"
    MAXIMIZE = "maximize"


class ParameterType(enum.Enum):
    INT = "int"
    DOUBLE = "double"
    CATEGORICAL = "categorical"
    DISCRETE = "discrete"


class Distribution(enum.Enum):
    UNIFORM = "uniform"
    LOG_UNIFORM = "logUniform"


class CollectorKind(enum.Enum):
    STDOUT = "StdOut"
    FILE = "File"
    PUSH = "Push"
    TRACE = "Trace"


class ResumePolicy(enum.Enum):
    NEVER = "Never"
    LONG_RUNNING = "LongRunning"
    FROM_VOLUME = "FromVolume"


@dataclass(frozen=True, slots=True)
class Parameter:
    """One search-space dimension. ``low``/``high``/``step`` for int and double; ``choices`` for
    categorical (strings) and discrete (numbers)."""

    name: str
    type: ParameterType
    low: float | None = None
    high: float | None = None
    step: float | None = None
    choices: tuple[Any, ...] = ()
    distribution: Distribution = Distribution.UNIFORM


@dataclass(frozen=True, slots=True)
class Objective:
    goal: Goal
    metric: str
    target: float | None = None
    """Katib's ``objective.goal``: reaching it ends the experiment (None: no target)."""
    additional_metrics: tuple[str, ...] = ()
    strategies: tuple[tuple[str, str], ...] = ()
    """(metric, min|max|latest): how a trial's series of a metric becomes one value."""

    def strategy(self, metric: str) -> str:
        return dict(self.strategies).get(metric, "min" if self.goal is Goal.MINIMIZE else "max")

    def reached(self, value: float) -> bool:
        if self.target is None:
            return False
        return value <= self.target if self.goal is Goal.MINIMIZE else value >= self.target


@dataclass(frozen=True, slots=True)
class Algorithm:
    name: str
    settings: tuple[tuple[str, str], ...] = ()

    def setting(self, name: str, default: str | None = None) -> str | None:
        return dict(self.settings).get(name, default)


@dataclass(frozen=True, slots=True)
class MetricsCollector:
    """How metrics leave a trial. ``filters`` are regexes with two groups (name, value); empty:
    Katib's default. ``path``/``file_format`` for the File kind (TEXT or JSON)."""

    kind: CollectorKind = CollectorKind.STDOUT
    filters: tuple[str, ...] = ()
    path: str | None = None
    file_format: str = "TEXT"


@dataclass(frozen=True, slots=True)
class TrialParameter:
    name: str
    reference: str


@dataclass(frozen=True, slots=True)
class TrialTemplate:
    """The trial template as Katib gives it: the raw ``trialSpec`` (placeholders still in it) and
    what substitutes into it. :mod:`opml_automl_controller.template` turns it into a job spec."""

    api_version: str
    kind: str
    spec: dict[str, Any]
    primary_container: str
    parameters: tuple[TrialParameter, ...]


@dataclass(frozen=True, slots=True)
class ExperimentSpec:
    name: str
    namespace: str
    objective: Objective
    algorithm: Algorithm
    parameters: tuple[Parameter, ...]
    trial_template: TrialTemplate
    max_trial_count: int
    parallel_trial_count: int = 3
    max_failed_trial_count: int | None = None
    early_stopping: Algorithm | None = None
    collector: MetricsCollector = field(default_factory=MetricsCollector)
    resume_policy: ResumePolicy = ResumePolicy.NEVER
    model: ModelPolicy | None = None
    """``spec.model``: the best trial's model is uploaded and committed (:mod:`.modelspec`); None: no model."""

    def parameter(self, name: str) -> Parameter:
        return next(p for p in self.parameters if p.name == name)


def parameter_text(value: Any) -> str:
    """A parameter's value as a trial template gets it (ints without '.0')."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return repr(value)
    return str(value)
