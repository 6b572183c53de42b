"""Optimization history and parameter importances of an experiment, by Optuna's own tools.

The trials (as ListTrials gives them) are loaded into an in-memory Optuna study with the
experiment's search space, so ``optuna.importance.get_param_importances`` (fANOVA by default) and
Optuna's matplotlib plots work on them as on any study; nothing here reaches the service's journal.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import optuna
from opml.automl.v1 import automl_pb2 as pb

from opml_automl_controller.algorithms import direction, search_space
from opml_automl_controller.experiment import ExperimentSpec, ParameterType

_STATES = {pb.TRIAL_STATE_SUCCEEDED: optuna.trial.TrialState.COMPLETE,
           pb.TRIAL_STATE_EARLY_STOPPED: optuna.trial.TrialState.PRUNED,
           pb.TRIAL_STATE_FAILED: optuna.trial.TrialState.FAIL, pb.TRIAL_STATE_KILLED: optuna.trial.TrialState.FAIL}


def study_of(spec: ExperimentSpec, trials: Sequence[pb.Trial]) -> optuna.Study:
    """An in-memory study holding the ended trials, their parameters typed as the search space says."""
    space = search_space(spec)
    study = optuna.create_study(direction=direction(spec))
    for trial in trials:
        if trial.state not in _STATES:
            continue
        params = {}
        for name, distribution in space.items():
            raw = trial.parameters.get(name)
            if raw is None:
                break
            parameter = spec.parameter(name)
            if isinstance(distribution, optuna.distributions.CategoricalDistribution):
                params[name] = next((c for c in distribution.choices if str(c) == raw or _same(c, raw)), raw)
            elif parameter.type is ParameterType.INT:
                params[name] = int(float(raw))
            else:
                params[name] = float(raw)
        else:
            state = _STATES[trial.state]
            study.add_trial(optuna.trial.create_trial(
                params=params, distributions=space, state=state,
                value=trial.objective_value if state is optuna.trial.TrialState.COMPLETE else None))
    return study


def _same(choice: object, raw: str) -> bool:
    try:
        return float(choice) == float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def importances(spec: ExperimentSpec, trials: Sequence[pb.Trial]) -> dict[str, float]:
    """Each parameter's share of the objective's variance (Optuna's default evaluator, fANOVA).

    Raises:
        ValueError: fewer than 2 succeeded trials (Optuna needs them).
    """
    study = study_of(spec, trials)
    complete = [t for t in study.trials if t.state is optuna.trial.TrialState.COMPLETE]
    if len(complete) < 2:
        raise ValueError(f"parameter importances need at least 2 succeeded trials, but the experiment has "
                         f"{len(complete)}")
    return optuna.importance.get_param_importances(study)


def history(spec: ExperimentSpec, trials: Sequence[pb.Trial]) -> list[tuple[int, float, float]]:
    """(trial number, its objective, the best so far) for each succeeded trial, in trial order."""
    better = min if direction(spec) == "minimize" else max
    rows, best = [], None
    for trial in sorted(trials, key=lambda t: t.number):
        if trial.state == pb.TRIAL_STATE_SUCCEEDED and trial.HasField("objective_value"):
            best = trial.objective_value if best is None else better(best, trial.objective_value)
            rows.append((trial.number, trial.objective_value, best))
    return rows


def plot(spec: ExperimentSpec, trials: Sequence[pb.Trial], path: Path) -> None:
    """A PNG of the optimization history and (with 2 or more succeeded trials) the importances."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = history(spec, trials)
    try:
        shares = importances(spec, trials)
    except ValueError:
        shares = {}
    figure, axes = plt.subplots(1, 2 if shares else 1, figsize=(13 if shares else 7, 4.5), squeeze=False)
    left = axes[0][0]
    left.scatter([r[0] for r in rows], [r[1] for r in rows], s=18, label="objective value")
    left.plot([r[0] for r in rows], [r[2] for r in rows], color="tab:red", label="best so far")
    left.set_xlabel("trial")
    left.set_ylabel(spec.objective.metric)
    left.set_title("optimization history")
    left.legend()
    if shares:
        right = axes[0][1]
        names = list(shares)[::-1]
        right.barh(names, [shares[n] for n in names])
        right.set_xlabel("importance (fANOVA, Optuna)")
        right.set_title("parameter importances")
    figure.suptitle(f"experiment {spec.name}: {spec.objective.metric} ({direction(spec)})")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
