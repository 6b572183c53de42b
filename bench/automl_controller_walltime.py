"""Wall time of an experiment with parallel trials and median stopping, against the same experiment
run one trial at a time without early stopping, measured in the same run on real services.

Starts its own embedded infrastructure (DevInfra: tansu, SeaweedFS; the machine's Redis), a
job-orchestrator and an automl-controller as processes, auth on, and runs the same Katib
experiment (random search, same seed, so the same parameters) twice. Each trial is a small Python
program printing ``loss=...`` per epoch: a good trial (x <= 0) trains ``--good-epochs``, a bad one
(x > 0) ``--bad-epochs``, ``--epoch-s`` each. Goal: parallel + early stopping under half the
sequential wall time.

    .venv/bin/python bench/automl_controller_walltime.py [--trials 12] [--parallel 3]
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path

import yaml
from _stack import automl_controller, bench_services
from opml.automl.v1 import automl_pb2 as pb

from opml_automl_controller_contract.client import ExperimentClient
from opml_devstack.testing.services import TOKENS

TRIAL = textwrap.dedent("""
    import sys, time
    x, good, bad, epoch_s = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    for epoch in range(bad if x > 0 else good):
        loss = 10.0 + x if x > 0 else (x + 0.5) ** 2 + 1.0 / (epoch + 1)
        print(f"epoch {epoch}: loss={loss:.6f}", flush=True)
        time.sleep(epoch_s)
""")


def experiment(name: str, program: Path, args: argparse.Namespace, *, parallel: int, early: bool) -> str:
    spec = {
        "objective": {"type": "minimize", "objectiveMetricName": "loss"},
        "algorithm": {"algorithmName": "random", "algorithmSettings": [{"name": "random_state", "value": "5"}]},
        "parallelTrialCount": parallel, "maxTrialCount": args.trials, "maxFailedTrialCount": 0,
        "parameters": [{"name": "x", "parameterType": "double", "feasibleSpace": {"min": "-1", "max": "1"}}],
        "trialTemplate": {"primaryContainerName": "main", "trialParameters": [{"name": "x", "reference": "x"}],
                          "trialSpec": {"apiVersion": "batch/v1", "kind": "Job", "spec": {"template": {"spec": {
                              "containers": [{"name": "main", "command": [
                                  sys.executable, str(program), "${trialParameters.x}", str(args.good_epochs),
                                  str(args.bad_epochs), str(args.epoch_s)],
                                  "resources": {"requests": {"cpu": "500m", "memory": "128Mi"}}}]}}}}}}
    if early:
        spec["earlyStopping"] = {"algorithmName": "medianstop", "algorithmSettings": [
            {"name": "min_trials_required", "value": "2"}, {"name": "start_step", "value": "3"}]}
    return yaml.safe_dump({"apiVersion": "kubeflow.org/v1beta1", "kind": "Experiment", "metadata": {"name": name},
                           "spec": spec})


def run(client: ExperimentClient, text: str, name: str) -> tuple[float, pb.Experiment, list[pb.Trial]]:
    started = time.perf_counter()
    client.create(text)
    while client.get(name).status.state == pb.EXPERIMENT_STATE_RUNNING:
        time.sleep(0.1)
    return time.perf_counter() - started, client.get(name), client.trials(name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--parallel", type=int, default=3)
    parser.add_argument("--good-epochs", type=int, default=10)
    parser.add_argument("--bad-epochs", type=int, default=40)
    parser.add_argument("--epoch-s", type=float, default=0.1)
    args = parser.parse_args()
    with bench_services() as (starter, workdir):
        program = workdir / "trial.py"
        program.write_text(TRIAL)
        target = automl_controller(starter, OPML_JOB_ORCHESTRATOR_TERMINATE_GRACE_S="2")
        with ExperimentClient(target, token=TOKENS["writer"]) as client:
            sequential, seq_exp, seq_trials = run(
                client, experiment("sequential", program, args, parallel=1, early=False), "sequential")
            fast, fast_exp, fast_trials = run(
                client, experiment("parallel", program, args, parallel=args.parallel, early=True), "parallel")

    def best(exp: pb.Experiment) -> float:
        return exp.status.current_optimal_trial.objective_value
    stopped = sum(t.state == pb.TRIAL_STATE_EARLY_STOPPED for t in fast_trials)
    print(f"{args.trials} trials (good {args.good_epochs} epochs, bad {args.bad_epochs}, {args.epoch_s} s each)")
    print(f"sequential, no early stopping: {sequential:6.1f} s, best loss {best(seq_exp):.4f}, "
          f"{len(seq_trials)} trials")
    print(f"{args.parallel} in parallel + medianstop: {fast:6.1f} s, best loss {best(fast_exp):.4f}, "
          f"{stopped} trials stopped early")
    print(f"ratio: {fast / sequential:.2f} (goal < 0.5)")


if __name__ == "__main__":
    main()
