"""Katib's algorithms as Optuna samplers and pruners (ask-and-tell only; nothing hand-written).

| Katib algorithm | Optuna |
|---|---|
| random | ``RandomSampler(seed)`` |
| grid | ``GridSampler`` over each parameter's min..max by step (or its list) |
| tpe | ``TPESampler`` (n_startup_trials, n_EI_candidates, gamma, prior_weight; constant_liar when parallel) |
| multivariate-tpe | ``TPESampler(multivariate=True)`` |
| cmaes | ``CmaEsSampler`` (sigma -> sigma0, restart_strategy ipop) |
| sobol | ``QMCSampler(qmc_type="sobol")`` |
| bayesianoptimization | ``GPSampler`` (n_initial_points -> n_startup_trials; needs the ``gp`` extra: PyTorch) |
| hyperband | ``RandomSampler`` + ``HyperbandPruner(min_resource=1, max_resource=r_l, reduction_factor=eta)`` |
| medianstop (early stopping) | ``MedianPruner(n_startup_trials=min_trials_required, n_warmup_steps=start_step)`` |

``random_state`` is every sampler's ``seed``. A sampler keeps no state of its own across a restart
of the controller: TPE, CMA-ES, grid, QMC and GP read the study's history from the storage, and a
seeded sampler is re-seeded with ``seed + len(trials so far)`` so a restarted random stream does
not repeat the values already tried.

Intermediate values are reported at steps 1, 2, 3... (the n-th observation of the objective
metric is step n), so ``n_warmup_steps = start_step`` lets the median rule act from the
start_step-th value on, as Katib's start_step does. Katib's rule compares a trial's value with the
mean of the completed trials' averages over their first start_step values; Optuna's, which is the
Vizier median stopping rule Katib's is named after, compares the trial's best value so far with
the median of the completed trials' values at the same step. Both wait for min_trials_required
succeeded trials (Optuna: ``n_startup_trials`` COMPLETE trials).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from opml_automl_controller.experiment import Distribution, ExperimentSpec, Goal, Parameter, ParameterType
from opml_automl_controller.katib import MAX_SEED, grid_values, missing_extra
from opml_common.errors import FailedPrecondition

MEDIANSTOP_DEFAULTS = {"min_trials_required": 3, "start_step": 4}
"""Katib's defaults (pkg/earlystopping/v1beta1/medianstop/service.py)."""


def direction(spec: ExperimentSpec) -> str:
    return "minimize" if spec.objective.goal is Goal.MINIMIZE else "maximize"


def resource_parameter(spec: ExperimentSpec) -> str | None:
    """Hyperband's resource parameter: not sampled, every trial gets ``r_l`` and reports one value per
    unit of it, and the pruner stops trials at hyperband's rungs."""
    return spec.algorithm.setting("resource_name") if spec.algorithm.name == "hyperband" else None


def distribution(parameter: Parameter, *, grid: bool = False) -> BaseDistribution:
    """The Optuna distribution of one parameter (grid: the grid's values, as a categorical)."""
    if grid or parameter.type in (ParameterType.CATEGORICAL, ParameterType.DISCRETE):
        return CategoricalDistribution(grid_values(parameter) if grid else list(parameter.choices))
    log = parameter.distribution is Distribution.LOG_UNIFORM
    assert parameter.low is not None and parameter.high is not None
    if parameter.type is ParameterType.INT:
        return IntDistribution(int(parameter.low), int(parameter.high), log=log,
                               step=int(parameter.step) if parameter.step and not log else 1)
    return FloatDistribution(parameter.low, parameter.high, log=log, step=None if log else parameter.step)


def search_space(spec: ExperimentSpec) -> dict[str, BaseDistribution]:
    """What every trial is asked over (``study.ask(fixed_distributions=...)``)."""
    skip = resource_parameter(spec)
    grid = spec.algorithm.name == "grid"
    return {p.name: distribution(p, grid=grid) for p in spec.parameters if p.name != skip}


def fixed_parameters(spec: ExperimentSpec) -> dict[str, Any]:
    """Parameters set, not sampled: hyperband's resource, at r_l."""
    name = resource_parameter(spec)
    return {name: int(float(spec.algorithm.setting("r_l") or 1))} if name else {}


def _int(settings: Mapping[str, str], key: str) -> int | None:
    return int(settings[key]) if key in settings else None


def make_sampler(spec: ExperimentSpec, *, trials_so_far: int = 0) -> optuna.samplers.BaseSampler:
    """The sampler of the experiment's algorithm (settings as :mod:`opml_automl_controller.katib`
    checked them), re-seeded past ``trials_so_far``. PyTorch is imported here, by GPSampler, only.

    Raises: FailedPrecondition: the algorithm's optional extra is not installed.
    """
    settings = dict(spec.algorithm.settings)
    seed = _int(settings, "random_state")
    if seed is not None:
        seed = (seed + trials_so_far) % (MAX_SEED + 1)  # still a numpy seed past 2**32 - 1
    name = spec.algorithm.name
    if name in ("random", "hyperband"):
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        grid = {p.name: grid_values(p) for p in spec.parameters}
        return optuna.samplers.GridSampler(grid, seed=seed)
    if name in ("tpe", "multivariate-tpe"):
        # constant liar: running trials count as bad, so trials asked side by side do not crowd one
        # spot (Optuna's advice for parallel optimization)
        kwargs: dict[str, Any] = {"seed": seed, "multivariate": name == "multivariate-tpe",
                                  "constant_liar": spec.parallel_trial_count > 1}
        if "n_startup_trials" in settings:
            kwargs["n_startup_trials"] = int(settings["n_startup_trials"])
        candidates = settings.get("n_EI_candidates", settings.get("n_ei_candidates"))
        if candidates is not None:
            kwargs["n_ei_candidates"] = int(candidates)
        if "prior_weight" in settings:
            kwargs["prior_weight"] = float(settings["prior_weight"])
        if "gamma" in settings:  # hyperopt's gamma is a fraction of the trials; Optuna's a function of n
            fraction = float(settings["gamma"])
            kwargs["gamma"] = lambda n: min(int(math.ceil(fraction * n)), 25)
        return optuna.samplers.TPESampler(**kwargs)
    if name == "cmaes":
        restart = (settings.get("restart_strategy") or "none").lower()
        return optuna.samplers.CmaEsSampler(
            seed=seed, sigma0=float(settings["sigma"]) if "sigma" in settings else None,
            restart_strategy=None if restart == "none" else restart)
    if name == "sobol":
        return optuna.samplers.QMCSampler(qmc_type="sobol", scramble=seed is not None, seed=seed,
                                          warn_independent_sampling=False)
    if name == "bayesianoptimization":
        if missing := missing_extra(name):  # admitted elsewhere, or the extra uninstalled since
            raise FailedPrecondition(missing)
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=_int(settings, "n_initial_points") or 10)
    raise ValueError(f"algorithm {name!r} has no sampler; the Katib checks should have refused it")


def make_pruner(spec: ExperimentSpec) -> optuna.pruners.BasePruner:
    """medianstop -> MedianPruner; hyperband -> HyperbandPruner; else none."""
    if spec.algorithm.name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=int(float(spec.algorithm.setting("r_l"))),
                                              reduction_factor=int(spec.algorithm.setting("eta") or 3))
    if spec.early_stopping is not None:
        settings = {**MEDIANSTOP_DEFAULTS, **{k: int(v) for k, v in spec.early_stopping.settings}}
        return optuna.pruners.MedianPruner(n_startup_trials=settings["min_trials_required"],
                                           n_warmup_steps=settings["start_step"])
    return optuna.pruners.NopPruner()
