"""A model's serving configuration searched on the router's performance model (automl-controller
trial kind ServingConfigSurrogate) against measuring configurations for real, in the same run.

Real services (embedded tansu, SeaweedFS, Redis; an inference-router with a cpu and an accel pool
and an automl-controller as processes). An MLP is deployed, 32 cpu configurations and 6 accel ones
are measured (MeasureServingConfigs: perfsample with the kind's session code), then per seed an
experiment of ``--trials`` multivariate-TPE trials searches the 96 accel configurations (batch 1-32,
threads 1-2, 4 optimization levels, 2 execution modes; int8) for throughput, each trial a
prediction of the accel model transferred from cpu. Last, every one of the 96 is measured (the
default 15 runs x 3 passes), which gives:

- the cost: surrogate trials per second (create to end, and CPU seconds of the controller and the
  router per trial) against configurations measured per second (and router CPU per configuration),
  in one call for the grid and one call per configuration (6 of them: what a trial measuring its
  own configuration would cost, its session built and the model converted each time);
- the quality: the measured throughput of each seed's best-found configuration against the best
  measured of the grid.

    .venv/bin/python bench/automl_serving_surrogate.py [--trials 40] [--seeds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import psutil
import yaml
from _stack import bench_services
from opml.automl.v1 import automl_pb2 as pb

from opml_automl_controller_contract.client import ExperimentClient
from opml_common.perfmodel import ServingConfig, grid
from opml_devstack.testing.bus import poll_until
from opml_devstack.testing.services import TOKENS
from opml_inference_router.testing import fleet_env, mlp_classifier, mlp_config, write_model_dir
from opml_inference_router_contract.client import DeploymentClient

VERSION = "models/mlp/versions/1"
BATCHES, THREADS, LEVELS, MODES = (1, 2, 4, 8, 16, 32), (1, 2), ("disable", "basic", "extended", "all"), (
    "sequential", "parallel")


def experiment(name: str, trials: int, seed: int) -> str:
    parameters = [
        {"name": "batch", "parameterType": "discrete", "feasibleSpace": {"list": [str(b) for b in BATCHES]}},
        {"name": "threads", "parameterType": "int", "feasibleSpace": {"min": "1", "max": "2"}},
        {"name": "optLevel", "parameterType": "categorical", "feasibleSpace": {"list": list(LEVELS)}},
        {"name": "mode", "parameterType": "categorical", "feasibleSpace": {"list": list(MODES)}}]
    config = {"batch": "${trialParameters.batch}", "threads": "${trialParameters.threads}",
              "optLevel": "${trialParameters.optLevel}", "executionMode": "${trialParameters.mode}",
              "precision": "int8"}
    return yaml.safe_dump({"apiVersion": "kubeflow.org/v1beta1", "kind": "Experiment", "metadata": {"name": name},
                           "spec": {
        "objective": {"type": "maximize", "objectiveMetricName": "throughput_rps",
                      "additionalMetricNames": ["latency_ms"]},
        "algorithm": {"algorithmName": "multivariate-tpe",
                      "algorithmSettings": [{"name": "random_state", "value": str(seed)}]},
        "parallelTrialCount": 3, "maxTrialCount": trials, "parameters": parameters,
        "trialTemplate": {
            "trialParameters": [{"name": p["name"], "reference": p["name"]} for p in parameters],
            "trialSpec": {"apiVersion": "jobs.opml.dev/v1", "kind": "ServingConfigSurrogate",
                          "spec": {"model": VERSION, "poolKind": "accel", "config": config}}}}})


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of the processes, their threads included."""
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def key(config) -> tuple:
    return (int(float(config.batch)), int(config.threads), config.opt_level, config.execution_mode)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    with bench_services() as (starter, workdir):
        router = starter("inference-router", extra_env=fleet_env(workdir / "fleet.yaml"))
        controller = starter("automl-controller", extra_env={
            "OPML_AUTOML_CONTROLLER_INFERENCE_ROUTER_TARGET": router.target,
            "OPML_AUTOML_CONTROLLER_INFERENCE_ROUTER_TOKEN": TOKENS["reader"],
            "OPML_AUTOML_CONTROLLER_RETRY_S": "0.2"})
        model_dir = write_model_dir(Path(workdir) / "mlp", mlp_config("mlp", features=64),
                                    mlp_classifier(features=64, width=1024, depth=2))
        space = list(grid(batches=BATCHES, threads=THREADS, opt_levels=LEVELS, modes=MODES, precisions=("int8",)))
        with DeploymentClient(router.target, token=TOKENS["writer"]) as routing, \
                ExperimentClient(controller.target, token=TOKENS["writer"]) as automl:
            routing.deploy(model_dir=str(model_dir))
            routing.measure_serving_configs(VERSION, "cpu", list(grid(
                batches=(1, 4, 16, 32), threads=(1, 2), opt_levels=("disable", "all"), modes=("sequential",))))
            routing.measure_serving_configs(VERSION, "accel", [ServingConfig(b, t, "all", "sequential", "int8") for
                                                               b, t in ((1, 1), (8, 1), (32, 1), (4, 2), (16, 2),
                                                                        (2, 1))])
            predicted = routing.predict_serving_performance(VERSION, "accel", space)
            print(f"accel model: {predicted.fit.method} from {predicted.fit.learned_on} "
                  f"({predicted.fit.source_samples} source, {predicted.fit.target_samples} target measurements)")

            pids = [router.process.pid, controller.process.pid]
            runs = []
            for seed in range(args.seeds):
                name = f"serving-{seed}"
                cpu, start = cpu_seconds(pids), time.perf_counter()
                automl.create(experiment(name, args.trials, seed))
                poll_until(lambda n=name: automl.get(n).status.state != pb.EXPERIMENT_STATE_RUNNING,
                           timeout_s=600, what=f"{name} ends", every_s=0.05)
                wall, cpu = time.perf_counter() - start, cpu_seconds(pids) - cpu
                done = automl.get(name)
                assert done.status.trials_succeeded == args.trials, done.status
                runs.append((wall, cpu, done.status.current_optimal_trial))

            singles = []  # a trial that measured its one configuration: one call each
            for config in space[::16]:
                cpu, start = cpu_seconds([router.process.pid]), time.perf_counter()
                routing.measure_serving_configs(VERSION, "accel", [config])
                singles.append((time.perf_counter() - start, cpu_seconds([router.process.pid]) - cpu))
            cpu, start = cpu_seconds([router.process.pid]), time.perf_counter()
            measured = routing.measure_serving_configs(VERSION, "accel", space)
            measure_wall, measure_cpu = time.perf_counter() - start, cpu_seconds([router.process.pid]) - cpu
    by_config = {key(s.config): s for s in measured.samples}
    best_measured = max(s.throughput_rps for s in measured.samples)
    best_predicted_key = key(max(predicted.predictions, key=lambda p: p.throughput_rps).config)
    per_trial_wall = [wall / args.trials for wall, _, _ in runs]
    per_trial_cpu = [cpu / args.trials for _, cpu, _ in runs]
    per_config_wall, per_config_cpu = measure_wall / len(space), measure_cpu / len(space)
    print(f"\nsurrogate: {args.trials} trials x {args.seeds} seeds; per trial wall "
          f"{statistics.fmean(per_trial_wall) * 1000:.1f} ms (min {min(per_trial_wall) * 1000:.1f}), "
          f"CPU (controller + router) {statistics.fmean(per_trial_cpu) * 1000:.1f} ms; "
          f"{args.trials / statistics.fmean([w for w, _, _ in runs]):.1f} trials/s")
    print(f"measured: {len(space)} configurations (15 runs x 3 passes) in {measure_wall:.1f} s: per configuration "
          f"wall {per_config_wall * 1000:.1f} ms, router CPU {per_config_cpu * 1000:.1f} ms; "
          f"{len(space) / measure_wall:.2f} configurations/s")
    single_wall = statistics.fmean(w for w, _ in singles)
    single_cpu = statistics.fmean(c for _, c in singles)
    print(f"measured one per call ({len(singles)} calls, as a trial measuring its configuration would): wall "
          f"{single_wall * 1000:.1f} ms, router CPU {single_cpu * 1000:.1f} ms per configuration")
    trial_wall, trial_cpu = statistics.fmean(per_trial_wall), statistics.fmean(per_trial_cpu)
    print(f"ratio: a surrogate trial costs 1/{per_config_wall / trial_wall:.1f} of a configuration measured in the "
          f"grid's one call (wall), 1/{per_config_cpu / trial_cpu:.1f} (CPU); 1/{single_wall / trial_wall:.1f} and "
          f"1/{single_cpu / trial_cpu:.1f} of one measured per call")
    print(f"\ngrid's best measured throughput: {best_measured:,.0f} rows/s "
          f"({max(measured.samples, key=lambda s: s.throughput_rps).config})")
    print(f"the model's predicted best {dict(zip(('batch', 'threads', 'optLevel', 'mode'), best_predicted_key))}, measured: {by_config[best_predicted_key].throughput_rps:,.0f} rows/s "
          f"({by_config[best_predicted_key].throughput_rps / best_measured:.2f} of the grid's best)")
    for seed, (_, _, best) in enumerate(runs):
        found = by_config[key(ServingConfig(int(float(best.parameters["batch"])), int(best.parameters["threads"]),
                                            best.parameters["optLevel"], best.parameters["mode"], "int8"))]
        rank = 1 + sum(s.throughput_rps > found.throughput_rps for s in measured.samples)
        print(f"seed {seed}: best trial {dict(best.parameters)} predicted {best.objective_value:,.0f}, measured "
              f"{found.throughput_rps:,.0f} rows/s = {found.throughput_rps / best_measured:.2f} of the grid's best "
              f"(rank {rank} of {len(space)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
