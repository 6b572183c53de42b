"""A cheap surrogate objective: an experiment over serving options (batch, threads, opt_level,
execution_mode, precision) searched on a performance model's predictions instead of trial jobs.

A trial that deploys and load-tests a configuration costs minutes; a prediction of a transferred
performance model (:mod:`opml_common.perfmodel`) costs microseconds. :func:`run_surrogate` runs the
experiment's own sampler over its own search space against the predictions, so its best
configurations can be shortlisted before (or instead of) real trials. Not wired into the
controller's experiments: a caller runs it on a parsed spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import optuna

from opml_automl_controller.algorithms import direction, make_sampler, search_space
from opml_automl_controller.experiment import ExperimentSpec
from opml_common.errors import InvalidArgument
from opml_common.perfmodel import Sample, ServingConfig

SERVING_PARAMETERS = ("batch", "threads", "opt_level", "execution_mode", "precision")
METRICS = ("latency_ms", "throughput_rps")


class Predictor(Protocol):
    """A fitted performance model (source or transferred)."""

    def predict_ms(self, samples: list[Sample]) -> np.ndarray: ...


class SurrogateObjective:
    """The predicted ``metric`` of a model of ``mflop_per_row`` work served as a trial's parameters say.

    Parameters not among :data:`SERVING_PARAMETERS` are refused by name; options a trial does not
    set keep ``defaults``."""

    def __init__(self, predictor: Predictor, *, mflop_per_row: float, metric: str = "latency_ms",
                 defaults: ServingConfig | None = None, model: str = "surrogate") -> None:
        """Raises: InvalidArgument for an unknown metric or a work that is not positive."""
        if metric not in METRICS:
            raise InvalidArgument("metric", f"must be one of {', '.join(METRICS)}, but got {metric!r}")
        if not mflop_per_row > 0:
            raise InvalidArgument("mflop_per_row", f"must be > 0, but got {mflop_per_row}")
        self.predictor, self.metric, self.mflop_per_row, self.model = predictor, metric, mflop_per_row, model
        self.defaults = defaults or ServingConfig(1)

    def config(self, params: Mapping[str, Any]) -> ServingConfig:
        """Raises: InvalidArgument for a parameter that is no serving option, or a value it cannot take."""
        unknown = sorted(set(params) - set(SERVING_PARAMETERS))
        if unknown:
            raise InvalidArgument(f"parameters[{unknown[0]}]", f"must be a serving option "
                                                               f"({', '.join(SERVING_PARAMETERS)}) for a surrogate")
        values = {name: getattr(self.defaults, name) for name in SERVING_PARAMETERS}
        values.update(params)
        return ServingConfig(int(values["batch"]), int(values["threads"]), str(values["opt_level"]),
                             str(values["execution_mode"]), str(values["precision"]))

    def __call__(self, params: Mapping[str, Any]) -> float:
        """Raises: InvalidArgument as :meth:`config`."""
        serving = self.config(params)
        ms = float(self.predictor.predict_ms([Sample(self.model, self.mflop_per_row, serving)])[0])
        return ms if self.metric == "latency_ms" else serving.batch * 1000.0 / ms


def run_surrogate(spec: ExperimentSpec, objective: SurrogateObjective, *, trials: int | None = None) -> optuna.Study:
    """The experiment's sampler over its search space, ``trials`` (default its maxTrialCount) asked and
    told in memory with the surrogate's values, in the experiment's direction.

    Raises: InvalidArgument when a parameter of the spec is no serving option.
    """
    study = optuna.create_study(sampler=make_sampler(spec), direction=direction(spec))
    space = search_space(spec)
    for _ in range(trials or spec.max_trial_count):
        trial = study.ask(fixed_distributions=space)
        study.tell(trial, objective(trial.params))
    return study
