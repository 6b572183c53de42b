"""automl-controller against plain Optuna on a Keras model, measured in the same run.

Both sides tune the same small Keras MLP on scikit-learn's digits (learning rate, log-uniform;
hidden units; validation accuracy after ``--epochs``, maximized) with the same sampler, seed and
trial budget, and each trial is the same program run as its own process (TensorFlow's start-up
included on both sides):

  controller  a Katib Experiment on real services: DevInfra (tansu, SeaweedFS, the machine's
              Redis), a job-orchestrator and an automl-controller as processes, auth on; each
              trial a TE job whose stdout's ``accuracy=...`` the StdOut collector reads.
  plain       ``optuna`` ask/tell with the sampler the controller builds from the same YAML
              (``make_sampler``), each trial the program run by ``subprocess``.

The program seeds Keras and asks TensorFlow for deterministic ops, so with one trial at a time the
two sides see the same values and ask the same parameters: any gap is the controller's. Goal:
equal best objective within noise; the wall time is printed beside (the controller's is its
orchestrator's job start-up plus trial bookkeeping).

    .venv/bin/python bench/automl_controller_keras.py [--trials 12] [--seeds 3] [--epochs 8]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import optuna
import yaml
from _stack import automl_controller, bench_services
from opml.automl.v1 import automl_pb2 as pb

from opml_automl_controller.algorithms import make_sampler, search_space
from opml_automl_controller.katib import parse_experiment
from opml_automl_controller_contract.client import ExperimentClient
from opml_devstack.testing.services import TOKENS

TRIAL = textwrap.dedent("""
    import os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    os.environ["TF_DETERMINISTIC_OPS"] = "1"
    lr, units, epochs, seed = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    import keras
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split((x / 16).astype("float32"), y, test_size=0.3, random_state=0)
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(units, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(keras.optimizers.Adam(lr), "sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x_train, y_train, epochs=epochs, batch_size=64, verbose=0)
    print(f"accuracy={model.evaluate(x_val, y_val, verbose=0)[1]:.6f}", flush=True)
""")


def experiment(name: str, program: Path, *, algorithm: str, seed: int, trials: int, epochs: int) -> str:
    container = {"name": "main", "command": [sys.executable, str(program), "${trialParameters.lr}",
                                             "${trialParameters.units}", str(epochs), str(seed)],
                 "resources": {"requests": {"cpu": "1000m", "memory": "1Gi"}}}
    spec = {
        "objective": {"type": "maximize", "objectiveMetricName": "accuracy"},
        "algorithm": {"algorithmName": algorithm, "algorithmSettings": [{"name": "random_state", "value": str(seed)}]},
        "parallelTrialCount": 1, "maxTrialCount": trials, "maxFailedTrialCount": 0,
        "parameters": [
            {"name": "lr", "parameterType": "double",
             "feasibleSpace": {"min": "0.0001", "max": "0.1", "distribution": "logUniform"}},
            {"name": "units", "parameterType": "int", "feasibleSpace": {"min": "4", "max": "128"}}],
        "trialTemplate": {"primaryContainerName": "main",
                          "trialParameters": [{"name": "lr", "reference": "lr"}, {"name": "units", "reference": "units"}],
                          "trialSpec": {"apiVersion": "batch/v1", "kind": "Job", "spec": {"template": {"spec": {
                              "containers": [container]}}}}}}
    return yaml.safe_dump({"apiVersion": "kubeflow.org/v1beta1", "kind": "Experiment", "metadata": {"name": name},
                           "spec": spec})


def run_controller(client: ExperimentClient, text: str, name: str) -> tuple[float, float]:
    """(best accuracy, wall seconds) of the experiment on the services."""
    started = time.perf_counter()
    client.create(text)
    while (state := client.get(name).status.state) == pb.EXPERIMENT_STATE_RUNNING:
        time.sleep(0.2)
    wall = time.perf_counter() - started
    if state != pb.EXPERIMENT_STATE_SUCCEEDED:
        raise SystemExit(f"experiment {name} ended {pb.ExperimentState.Name(state)}: {client.get(name).status}")
    return client.get(name).status.current_optimal_trial.objective_value, wall


def run_plain(text: str, program: Path, *, epochs: int, seed: int) -> tuple[float, float]:
    """(best accuracy, wall seconds) of plain Optuna with the controller's sampler for the same YAML."""
    spec = parse_experiment(text)
    study = optuna.create_study(direction="maximize", sampler=make_sampler(spec))
    space = search_space(spec)
    started = time.perf_counter()
    for _ in range(spec.max_trial_count):
        trial = study.ask(fixed_distributions=space)
        out = subprocess.run([sys.executable, str(program), repr(float(trial.params["lr"])),
                              str(int(trial.params["units"])), str(epochs), str(seed)],
                             capture_output=True, text=True, check=True).stdout
        study.tell(trial, float(re.findall(r"accuracy=([0-9.]+)", out)[-1]))
    return study.best_value, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--algorithm", default="tpe")
    args = parser.parse_args()
    rows = []
    with bench_services() as (starter, workdir):
        program = workdir / "trial.py"
        program.write_text(TRIAL)
        with ExperimentClient(automl_controller(starter), token=TOKENS["writer"]) as client:
            for seed in range(args.seeds):
                name = f"keras-{args.algorithm}-{seed}-{uuid.uuid4().hex[:6]}"
                text = experiment(name, program, algorithm=args.algorithm, seed=seed, trials=args.trials,
                                  epochs=args.epochs)
                ours, ours_wall = run_controller(client, text, name)
                plain, plain_wall = run_plain(text, program, epochs=args.epochs, seed=seed)
                rows.append((seed, ours, plain, ours_wall, plain_wall))
                print(f"seed {seed}: controller {ours:.4f} ({ours_wall:.1f} s), plain Optuna {plain:.4f} "
                      f"({plain_wall:.1f} s)", flush=True)
    ours, plain = [r[1] for r in rows], [r[2] for r in rows]
    print(f"\n{args.algorithm}, {args.trials} trials, one at a time, {args.epochs} epochs, {len(rows)} seeds: best "
          f"validation accuracy controller {statistics.mean(ours):.4f}, plain Optuna {statistics.mean(plain):.4f} "
          f"(ratio {statistics.mean(ours) / statistics.mean(plain):.3f}); same best in "
          f"{sum(abs(a - b) < 1e-6 for a, b in zip(ours, plain, strict=True))}/{len(rows)} seeds; wall per trial "
          f"controller {statistics.mean(r[3] for r in rows) / args.trials:.2f} s, plain "
          f"{statistics.mean(r[4] for r in rows) / args.trials:.2f} s")


if __name__ == "__main__":
    main()
