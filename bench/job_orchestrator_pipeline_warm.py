"""Warm start against cold start on a new span: a Keras model's wall time to the same validation accuracy.

The train step's own code path without the services around it: the job is built by
``steps.train_job`` (what ``Runner._train`` submits: the user's command with ``OPML_PIPELINE_SPANS``,
``OPML_PIPELINE_MODEL_DIR`` and, warm, ``OPML_PIPELINE_WARM_START`` holding the blessed model's
files) and its command run as a process with that environment, as the local executor runs it
(without the sandbox). The program is ``bench/_pipeline_keras_train.py``: a Keras MLP trained
epoch by epoch until the newest span's held-out fifth reaches ``--target`` accuracy.

Each round (a seed): span 1 and span 2 of a stream whose inputs drift (the label's rule holds);
the blessed model is trained cold on span 1; then span 2 is trained cold (the baseline) and warm
from the blessed model, in alternating order. Reported: seconds from the process's start to the
target (TensorFlow's import included: the job pays it), of them the set-up (imports, spans read,
model built or loaded), epochs, the whole job's wall time, and warm / cold per round. Goal: warm
<= 0.5x cold.

    .venv/bin/python bench/job_orchestrator_pipeline_warm.py [--rounds 5] [--rows 20000] [--target 0.97] [--drift 0.3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from opml.jobs.v1 import jobs_pb2 as jobs_pb
from opml.jobs.v1 import pipelines_pb2 as pb

from opml_job_orchestrator.pipelines.steps import train_job

PROGRAM = Path(__file__).with_name("_pipeline_keras_train.py")
FEATURES = 8


def span_csv(path: Path, seed: int, rows: int, drift: float) -> None:
    """A span: 8 features whose means drift by ``drift``; label = a fixed nonlinear rule of them."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)) + drift * np.linspace(1.0, -1.0, FEATURES)
    score = np.sin(2 * x[:, 0]) + x[:, 1] * x[:, 2] + 0.5 * x[:, 3] ** 2 - 0.5 * x[:, 4] - 0.5
    y = (score > 0).astype(int)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = ",".join(f"x{i}" for i in range(FEATURES)) + ",label"
    np.savetxt(path, np.column_stack([x, y]), delimiter=",", header=header, comments="", fmt=["%.5f"] * FEATURES + ["%d"])


def train(folder: Path, span: Path, warm: Path | None, args: argparse.Namespace, seed: int) -> dict:
    """One train step's job over ``span`` (warm from ``warm``), as ``Runner._train`` builds it."""
    step = folder / ("warm" if warm else "cold")
    shutil.rmtree(step, ignore_errors=True)
    (step / "spans").mkdir(parents=True)
    shutil.copytree(span, step / "spans" / span.name)
    (step / "model").mkdir()
    config = pb.TrainConfig(command=[sys.executable, str(PROGRAM)], warm_start=warm is not None,
                            env={"TARGET_ACCURACY": str(args.target), "MAX_EPOCHS": str(args.max_epochs),
                                 "SEED": str(seed)},
                            resources=jobs_pb.Resources(cpu_millis=2000, memory_mib=2048))
    job = train_job(f"bench-{seed}", config, spans=step / "spans", model_dir=step / "model", warm_start=warm,
                    labels={})
    started = time.monotonic()
    done = subprocess.run(job.program.commands["worker"], env={**os.environ, **job.program.env},
                          capture_output=True, text=True, check=False)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"the training job failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["reached"]:
        raise SystemExit(f"the job did not reach {args.target} in {args.max_epochs} epochs: {result}")
    return {**result, "wall": wall, "model": step / "model"}


def training(result: dict) -> float:
    """Seconds from the model ready to train to the target (the set-up left out)."""
    return result["seconds_to_target"] - result["setup_seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--drift", type=float, default=0.3, help="how far span 2's means move from span 1's")
    parser.add_argument("--max-epochs", type=int, default=200)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}; {args.rounds} rounds, {args.rows} rows a span, "
          f"target accuracy {args.target}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="warm-bench-") as scratch:
        root = Path(scratch)
        for seed in range(args.rounds):
            folder = root / f"round-{seed}"
            span_csv(folder / "data" / "1" / "part-0.csv", 2 * seed, args.rows, drift=0.0)
            span_csv(folder / "data" / "2" / "part-0.csv", 2 * seed + 1, args.rows, drift=args.drift)
            blessed = folder / "blessed"
            first = train(folder, folder / "data" / "1", None, args, seed)
            shutil.copytree(first["model"], blessed)
            order = ("warm", "cold") if seed % 2 else ("cold", "warm")
            got = {way: train(folder, folder / "data" / "2", blessed if way == "warm" else None, args, seed)
                   for way in order}
            cold, warm = got["cold"], got["warm"]
            rows.append((cold, warm))
            print(f"round {seed}: cold {cold['seconds_to_target']:.2f} s ({cold['epochs']} epochs, set-up "
                  f"{cold['setup_seconds']:.2f} s, job {cold['wall']:.2f} s), warm {warm['seconds_to_target']:.2f} s "
                  f"({warm['epochs']} epochs, set-up {warm['setup_seconds']:.2f} s, job {warm['wall']:.2f} s): "
                  f"warm/cold {warm['seconds_to_target'] / cold['seconds_to_target']:.3f} to target, "
                  f"{training(warm) / training(cold):.3f} training alone, {warm['wall'] / cold['wall']:.3f} whole job; "
                  f"load average {os.getloadavg()[0]:.1f}", flush=True)
    ratios = [w["seconds_to_target"] / c["seconds_to_target"] for c, w in rows]
    alone = [training(w) / training(c) for c, w in rows]
    jobs = [w["wall"] / c["wall"] for c, w in rows]
    print(f"median cold {statistics.median(c['seconds_to_target'] for c, _ in rows):.2f} s "
          f"({statistics.median(c['epochs'] for c, _ in rows)} epochs), warm "
          f"{statistics.median(w['seconds_to_target'] for _, w in rows):.2f} s "
          f"({statistics.median(w['epochs'] for _, w in rows)} epochs)")
    print(f"warm/cold to target: median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}); "
          f"training alone (after the set-up): median {statistics.median(alone):.3f}; "
          f"whole job: median {statistics.median(jobs):.3f}; goal <= 0.5: "
          f"{'met' if statistics.median(ratios) <= 0.5 else 'NOT met'}")


if __name__ == "__main__":
    main()
