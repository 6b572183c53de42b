"""Step 2, tune: an automl experiment over the committed spans, its trials TE jobs, traced.

Shows the automl-controller as a Katib user meets it: a v1beta1 Experiment YAML (TPE, median stop)
whose trials are the job-orchestrator's TE jobs running an unchanged Keras program
(``tune_trial.py``); the ``Trace`` metrics collector reads each epoch's ``val_accuracy`` from the
tracer in the job (no log parsing, no SDK call for metrics), so median stop acts on epochs as they
end; each trial uploads its model with its own grant and the best is committed as a bundle. The best
trial's job as the trace-collector aggregated it (its runs, patched calls and step metrics) ends it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import yaml
from opml.automl.v1 import automl_pb2

from opml_automl_controller_contract.client import ExperimentClient
from opml_trace_collector_contract.client import TraceCollectorClient

from .context import Story, wait_for

TRIAL = Path(__file__).resolve().parent / "tune_trial.py"
OBJECTIVE = "val_accuracy"
ENDED = {automl_pb2.EXPERIMENT_STATE_SUCCEEDED, automl_pb2.EXPERIMENT_STATE_FAILED,
         automl_pb2.EXPERIMENT_STATE_STOPPED}


def experiment_yaml(story: Story, name: str) -> str:
    """The Katib Experiment: TPE over the learning rate and the hidden width, median stop on epochs."""
    argv = [sys.executable, str(TRIAL), "--spans", str(story.spans_dir),
            "--learning-rate=${trialParameters.learningRate}", "--units=${trialParameters.units}",
            f"--epochs={story.scale.trial_epochs}"]
    return yaml.safe_dump({
        "apiVersion": "kubeflow.org/v1beta1", "kind": "Experiment", "metadata": {"name": name},
        "spec": {
            "objective": {"type": "maximize", "objectiveMetricName": OBJECTIVE},
            "algorithm": {"algorithmName": "tpe", "algorithmSettings": [{"name": "random_state", "value": "7"}]},
            "earlyStopping": {"algorithmName": "medianstop", "algorithmSettings": [
                {"name": "min_trials_required", "value": "2"}, {"name": "start_step", "value": "2"}]},
            "metricsCollectorSpec": {"collector": {"kind": "Trace"}},
            "parallelTrialCount": story.scale.parallel_trials, "maxTrialCount": story.scale.trials,
            "maxFailedTrialCount": 0,
            "model": {"commit": True},
            "parameters": [
                {"name": "learning_rate", "parameterType": "double",
                 "feasibleSpace": {"min": "0.0005", "max": "0.02", "distribution": "logUniform"}},
                {"name": "units", "parameterType": "int", "feasibleSpace": {"min": "16", "max": "128"}}],
            "trialTemplate": {
                "primaryContainerName": "main",
                "trialParameters": [{"name": "learningRate", "reference": "learning_rate"},
                                    {"name": "units", "reference": "units"}],
                "trialSpec": {"apiVersion": "batch/v1", "kind": "Job", "spec": {"template": {"spec": {
                    "containers": [{"name": "main", "image": "python:3.11", "command": argv,
                                    "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}}]}}}}}}})


def show_trace(story: Story, job_id: str) -> None:
    """What the trace-collector aggregated of a traced job: its runs and step metrics."""
    with TraceCollectorClient(story.traces_target) as traces:
        runs = wait_for("the job's traced run reaching the trace-collector",
                        lambda: [r for r in traces.list_runs(job_id) if r.steps], timeout_s=60)
        for run in runs:
            print(f"   run {run.worker} session {run.session_id[:8]}: TensorFlow {run.tf_version}, "
                  f"{run.steps} steps, patched {', '.join(run.patched[:3])}...")
        metrics = traces.summary(job_id).metrics
    print(f"   step time mean {metrics.step_time_s * 1000:.1f} ms (p95 {metrics.step_time_p95_s * 1000:.1f} ms), "
          f"{metrics.examples_per_second:.0f} examples/s, input wait {metrics.input_s * 1000:.2f} ms/step")


def run(story: Story) -> str:
    name = f"inspection-tune-{int(time.time())}"
    with ExperimentClient(story.automl_target) as client:
        created = client.create(experiment_yaml(story, name))
        print(f"   experiment {created.name.split('/')[-1]}: {created.algorithm}, {created.max_trial_count} trials "
              f"({created.parallel_trial_count} at once), maximize {created.objective_metric}, median stop, "
              f"Trace collector")
        seen: dict[int, int] = {}

        def ended() -> automl_pb2.Experiment | None:
            for trial in client.trials(name):
                if seen.get(trial.number) != trial.state:
                    seen[trial.number] = trial.state
                    value = f" {OBJECTIVE}={trial.objective_value:.3f}" if trial.HasField("objective_value") else ""
                    print(f"   trial {trial.number} {dict(trial.parameters)} "
                          f"{automl_pb2.TrialState.Name(trial.state)}{value} {trial.message}".rstrip())
            experiment = client.get(name)
            return experiment if experiment.status.state in ENDED else None

        experiment = wait_for(f"experiment {name} ending", ended, timeout_s=600)
        trials = client.trials(name)
    status = experiment.status
    if status.state != automl_pb2.EXPERIMENT_STATE_SUCCEEDED:
        raise SystemExit(f"experiment {name} ended {automl_pb2.ExperimentState.Name(status.state)}: "
                         f"{status.reason} {status.message}")
    best = status.current_optimal_trial
    print(f"   {automl_pb2.ExperimentState.Name(status.state)} {status.reason}: {status.trials_succeeded} succeeded, "
          f"{status.trials_early_stopped} early-stopped; best trial {best.number} {dict(best.parameters)} "
          f"{OBJECTIVE}={best.objective_value:.3f}")
    if not experiment.best_model_bundle:
        raise SystemExit(f"experiment {name} committed no best model: {status.message}")
    print(f"   best model committed: {experiment.best_model_bundle}")
    [job_id] = [t.job_id for t in trials if t.number == best.number]
    print(f"   the best trial's job {job_id} as the trace-collector aggregated it (its program unchanged)")
    show_trace(story, job_id)
    story.handed["trials"] = [(t.number, automl_pb2.TrialState.Name(t.state),
                               t.objective_value if t.HasField("objective_value") else None) for t in trials]
    story.handed["best"] = dict(best.parameters)
    return f"{status.trials} trials, best {OBJECTIVE} {best.objective_value:.3f}"
