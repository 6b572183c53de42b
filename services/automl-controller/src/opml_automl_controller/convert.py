"""Conversions between the controller's records and the opml.automl.v1 messages (no logic here)."""

from __future__ import annotations

import math

from google.protobuf.timestamp_pb2 import Timestamp
from opml.automl.v1 import automl_pb2 as pb
from opml.automl.v1 import events_pb2

from opml_automl_controller.collect import summarize
from opml_automl_controller.experiment import ExperimentSpec
from opml_automl_controller.state import ExperimentRecord, ExperimentState, TrialRecord, TrialState
from opml_automl_controller_contract.names import experiment_name, trial_name

EXPERIMENT_STATES = {state: pb.ExperimentState.Value(f"EXPERIMENT_STATE_{state.name}") for state in ExperimentState}
TRIAL_STATES = {state: pb.TrialState.Value(f"TRIAL_STATE_{state.name}") for state in TrialState}


def _timestamp(seconds: float | None) -> Timestamp | None:
    if seconds is None:
        return None
    whole = math.floor(seconds)
    return Timestamp(seconds=whole, nanos=min(999_999_999, round((seconds - whole) * 1e9)))


def trial_to_proto(trial: TrialRecord) -> pb.Trial:
    message = pb.Trial(name=trial_name(trial.experiment, trial.number), number=trial.number,
                       parameters=trial.parameters, state=TRIAL_STATES[trial.state], job_id=trial.job_id,
                       message=trial.message, start_time=_timestamp(trial.started_at),
                       end_time=_timestamp(trial.ended_at))
    for metric, values in trial.observations.items():
        if values:
            message.metrics.append(pb.Metric(name=metric, min=min(values), max=max(values),
                                             latest=summarize(values, "latest") or 0.0, count=len(values)))
    if trial.objective_value is not None:
        message.objective_value = trial.objective_value
    return message


def best_trial(spec: ExperimentSpec, trials: tuple[TrialRecord, ...] | list[TrialRecord]) -> TrialRecord | None:
    done = [t for t in trials if t.state is TrialState.SUCCEEDED and t.objective_value is not None]
    if not done:
        return None
    pick = min if spec.objective.goal.value == "minimize" else max
    return pick(done, key=lambda t: t.objective_value or 0.0)


def experiment_to_proto(record: ExperimentRecord, spec: ExperimentSpec | None,
                        trials: tuple[TrialRecord, ...] | list[TrialRecord], *, with_yaml: bool = True) -> pb.Experiment:
    """``spec`` None: a stored experiment that no longer parses; only its record's fields are set."""
    count = {state: sum(1 for t in trials if t.state is state) for state in TrialState}
    status = pb.ExperimentStatus(
        state=EXPERIMENT_STATES[record.state], reason=record.reason, message=record.message, trials=len(trials),
        trials_running=count[TrialState.RUNNING] + count[TrialState.CREATED],
        trials_succeeded=count[TrialState.SUCCEEDED], trials_failed=count[TrialState.FAILED],
        trials_early_stopped=count[TrialState.EARLY_STOPPED], trials_killed=count[TrialState.KILLED],
        create_time=_timestamp(record.created_at), completion_time=_timestamp(record.completed_at))
    message = pb.Experiment(
        name=experiment_name(record.name), katib_yaml=record.katib_yaml if with_yaml else "",
        max_trial_count=record.max_trial_count, status=status, best_model_bundle=record.best_model_bundle)
    if spec is None:
        return message
    best = best_trial(spec, trials)
    if best is not None:
        message.status.current_optimal_trial.CopyFrom(trial_to_proto(best))
    message.objective_metric, message.objective_type = spec.objective.metric, spec.objective.goal.value
    message.algorithm, message.parallel_trial_count = spec.algorithm.name, spec.parallel_trial_count
    message.resume_policy = spec.resume_policy.value
    if spec.objective.target is not None:
        message.goal = spec.objective.target
    if spec.max_failed_trial_count is not None:
        message.max_failed_trial_count = spec.max_failed_trial_count
    return message


def experiment_event(record: ExperimentRecord, spec: ExperimentSpec | None, trials: tuple[TrialRecord, ...] | list[TrialRecord],
                     *, deleted: bool = False) -> events_pb2.ExperimentChanged:
    return events_pb2.ExperimentChanged(experiment=experiment_to_proto(record, spec, trials, with_yaml=False),
                                        deleted=deleted)


def trial_event(trial: TrialRecord) -> events_pb2.TrialChanged:
    return events_pb2.TrialChanged(experiment=experiment_name(trial.experiment), trial=trial_to_proto(trial))
