"""automl-controller against plain Optuna, measured in the same run.

1. Best objective: the controller (its Katib parsing, its samplers, its parallel trials, its Redis
   journal and records) against plain Optuna (``study.optimize`` with the same sampler and seed,
   one trial at a time, in memory) on standard functions, for several seeds and the same budget.
   Goal: equal within noise. The controller is also run one trial at a time ("ctl 1 at once"): with
   the same seed it must find what plain Optuna finds, so any gap in the parallel column is the cost
   of asking before the running trials' results are in (TPE's constant liar, CMA-ES's generations).
2. The controller's added time per trial: the wall time per trial of an experiment whose trials
   cost nothing (a job that reports its value at once), minus plain Optuna's ask+tell time per trial
   on an in-memory study (and on the same Redis journal, to separate the storage's share).
   Goal: under 50 ms.

The controller core runs in process against a stand-in orchestrator that evaluates the function
when the job is submitted (no processes): what is measured is the controller, not job start-up.
Needs the machine's Redis at 127.0.0.1:6379.

    .venv/bin/python bench/automl_controller_optuna.py [--trials 30] [--seeds 3] [--parallel 3]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import optuna
import redis.asyncio as aioredis
import yaml
from _stack import deleting_redis_keys
from opml.jobs.v1 import jobs_pb2
from optuna.storages.journal import JournalRedisBackend, JournalStorage

from opml_automl_controller.algorithms import make_sampler, search_space
from opml_automl_controller.controller import Controller
from opml_automl_controller.jobs import JobView, TrialJobs
from opml_automl_controller.katib import parse_experiment
from opml_automl_controller.state import ExperimentState, ExperimentStore
from opml_common.events import RecordingEmitter

REDIS = "redis://127.0.0.1:6379/0"
RUN_PREFIX = f"opml-bench:automl-{uuid.uuid4().hex[:8]}:"
"""Every key of this run (the controllers' records and journals, plain Optuna's journals), deleted at its end."""
optuna.logging.set_verbosity(optuna.logging.ERROR)


def branin(p: dict[str, float]) -> float:
    x, y = p["x"], p["y"]
    return (y - 5.1 / (4 * math.pi ** 2) * x ** 2 + 5 / math.pi * x - 6) ** 2 + 10 * (1 - 1 / (8 * math.pi)) * \
        math.cos(x) + 10


def rosenbrock(p: dict[str, float]) -> float:
    return (1 - p["x"]) ** 2 + 100 * (p["y"] - p["x"] ** 2) ** 2


def sphere(p: dict[str, float]) -> float:
    return p["x"] ** 2 + p["y"] ** 2


FUNCTIONS: dict[str, tuple[Callable[[dict[str, float]], float], tuple[float, float], tuple[float, float]]] = {
    "branin": (branin, (-5, 10), (0, 15)), "rosenbrock": (rosenbrock, (-2, 2), (-1, 3)),
    "sphere": (sphere, (-5, 5), (-5, 5)),
}


def experiment(name: str, function: str, algorithm: str, seed: int, trials: int, parallel: int) -> str:
    _, (xl, xh), (yl, yh) = FUNCTIONS[function]
    return yaml.safe_dump({"apiVersion": "kubeflow.org/v1beta1", "kind": "Experiment", "metadata": {"name": name},
        "spec": {"objective": {"type": "minimize", "objectiveMetricName": "f"},
                 "algorithm": {"algorithmName": algorithm, "algorithmSettings": [
                     {"name": "random_state", "value": str(seed)}]},
                 "parallelTrialCount": parallel, "maxTrialCount": trials,
                 "parameters": [{"name": "x", "parameterType": "double", "feasibleSpace": {"min": str(xl), "max": str(xh)}},
                                {"name": "y", "parameterType": "double", "feasibleSpace": {"min": str(yl), "max": str(yh)}}],
                 "trialTemplate": {"primaryContainerName": "main", "trialParameters": [
                     {"name": "x", "reference": "x"}, {"name": "y", "reference": "y"}],
                     "trialSpec": {"apiVersion": "batch/v1", "kind": "Job", "spec": {"template": {"spec": {
                         "containers": [{"name": "main", "command": [
                             function, "${trialParameters.x}", "${trialParameters.y}"]}]}}}}}}})


class InstantJobs(TrialJobs):
    """Jobs that compute the function of their argv when submitted and end at once."""

    def __init__(self) -> None:
        self.logs: dict[str, str] = {}
        self.lock = threading.Lock()

    def ensure(self, spec: jobs_pb2.JobSpec) -> JobView:
        function, x, y = list(spec.roles["worker"].command)
        with self.lock:
            self.logs.setdefault(spec.name, f"f={FUNCTIONS[function][0]({'x': float(x), 'y': float(y)})!r}\n")
        return JobView(spec.name, "succeeded")

    def get(self, job_id: str) -> JobView:
        return JobView(job_id, "succeeded")

    def cancel(self, job_id: str) -> JobView:
        return JobView(job_id, "succeeded")

    def follow(self, job_id: str) -> Iterator[str]:
        yield self.logs[job_id]


async def run_controller(function: str, algorithm: str, seed: int, trials: int, parallel: int) -> tuple[float, float]:
    """(best value, wall seconds) of one experiment on the controller."""
    client = aioredis.from_url(REDIS)
    store = ExperimentStore(client, prefix=f"{RUN_PREFIX}{uuid.uuid4().hex[:8]}:")
    controller = Controller(store=store, jobs=InstantJobs(), emitter=RecordingEmitter(), redis_url=REDIS,
                            retry_s=0.05)
    await controller.start()
    name = f"b-{function}-{algorithm}-{seed}"
    started = time.perf_counter()
    await controller.create(experiment(name, function, algorithm, seed, trials, parallel))
    while (await controller.get(name)).record.state is ExperimentState.RUNNING:
        await asyncio.sleep(0.005)
    wall = time.perf_counter() - started
    view = await controller.get(name)
    await controller.stop()
    await client.aclose()
    best = view.best()
    assert best is not None and len(view.trials) == trials
    return float(best.objective_value), wall


def run_plain(function: str, algorithm: str, seed: int, trials: int, *, storage=None,
              parallel: int = 1) -> tuple[float, float]:
    """(best value, seconds of ask+tell per trial) of plain Optuna, same sampler, ``parallel`` trials
    pending at a time (each told in the order it was asked)."""
    spec = parse_experiment(experiment("plain", function, algorithm, seed, trials, parallel))
    study = optuna.create_study(sampler=make_sampler(spec), storage=storage,
                                study_name=f"plain-{uuid.uuid4().hex[:8]}")
    space = search_space(spec)
    evaluate = FUNCTIONS[function][0]
    spent, asked, pending = 0.0, 0, []
    while asked < trials or pending:
        started = time.perf_counter()
        if asked < trials and len(pending) < parallel:
            pending.append(study.ask(fixed_distributions=space))
            asked += 1
        else:
            trial = pending.pop(0)
            study.tell(trial, evaluate(trial.params))
        spent += time.perf_counter() - started
    return study.best_value, spent / trials


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--parallel", type=int, default=3)
    parser.add_argument("--algorithms", default="random,tpe,cmaes")
    args = parser.parse_args()
    print(f"best objective after {args.trials} trials, mean over {args.seeds} seeds (controller: "
          f"{args.parallel} trials at once; plain Optuna: one at a time, same sampler and seed)")
    print(f"{'function':<11} {'algorithm':<9} {'controller':>12} {f'plain {args.parallel} at once':>17} "
          f"{'ctl 1 at once':>14} {'plain optuna':>13} {'ratio':>7} {f'ratio {args.parallel}':>8} {'ratio 1':>8}")
    overheads, plain_times, journal_times = [], [], []
    for function in FUNCTIONS:
        for algorithm in args.algorithms.split(","):
            ours, serial, theirs, theirs_parallel = [], [], [], []
            for seed in range(args.seeds):
                best, wall = asyncio.run(run_controller(function, algorithm, seed, args.trials, args.parallel))
                serial.append(asyncio.run(run_controller(function, algorithm, seed, args.trials, 1))[0])
                plain_best, per_trial = run_plain(function, algorithm, seed, args.trials)
                theirs_parallel.append(run_plain(function, algorithm, seed, args.trials, parallel=args.parallel)[0])
                ours.append(best)
                theirs.append(plain_best)
                plain_times.append(per_trial)
            mean_ours, mean_theirs = statistics.mean(ours), statistics.mean(theirs)
            mean_serial = statistics.mean(serial)
            ratio = mean_ours / mean_theirs if mean_theirs else float("nan")
            ratio_serial = mean_serial / mean_theirs if mean_theirs else float("nan")
            mean_parallel = statistics.mean(theirs_parallel)
            ratio_parallel = mean_ours / mean_parallel if mean_parallel else float("nan")
            print(f"{function:<11} {algorithm:<9} {mean_ours:>12.4g} {mean_parallel:>17.4g} {mean_serial:>14.4g} "
                  f"{mean_theirs:>13.4g} {ratio:>7.2f} {ratio_parallel:>8.2f} {ratio_serial:>8.2f}")
    for seed in range(args.seeds):  # one trial at a time: the wall per trial is the controller's own work
        wall = asyncio.run(run_controller("sphere", "random", seed, args.trials, 1))[1]
        overheads.append(wall / args.trials - run_plain("sphere", "random", seed, args.trials)[1])
        storage = JournalStorage(JournalRedisBackend(REDIS, prefix=f"{RUN_PREFIX}journal-{uuid.uuid4().hex[:8]}"))
        journal_times.append(run_plain("sphere", "random", seed, args.trials, storage=storage)[1])
    print(f"plain Optuna ask+tell per trial: in memory {statistics.mean(plain_times) * 1e3:.2f} ms, on the Redis "
          f"journal {statistics.mean(journal_times) * 1e3:.2f} ms")
    print(f"controller's added time per trial (an experiment of instant trials, one at a time: its wall time "
          f"per trial minus plain in-memory ask+tell): median {statistics.median(overheads) * 1e3:.1f} ms, max {max(overheads) * 1e3:.1f} ms "
          f"(goal < 50 ms)")


if __name__ == "__main__":
    with deleting_redis_keys(REDIS, RUN_PREFIX):
        main()
