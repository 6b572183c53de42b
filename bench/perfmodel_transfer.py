"""Performance models that transfer (Iqbal, Kotthoff, Jamshidi, OpML '19): transfer error against
learning from scratch at 5, 10 and 20 target measurements, in the same run, over several seeds.

Environments are two pool kinds of the router's fleet (fleet-local.yaml), measured with the worker's
own session code (opml_inference_router.runtime.perfsample):

- source ``cpu``: CPUExecutionProvider, any batch shape; fp32, and int8 by the router's int8
  emulation (what a cpu kind declaring ``precisions: [fp32, int8]`` runs), so precision is an option;
- target ``accel``: the emulated int8 accelerator: int8 only, batches padded to its fixed shapes.

Both run on this machine's cores: the kinds differ by what the router gives their workers
(int8 emulation, fixed shapes), not by hardware. Options: batch (1..32), intra-op threads (1, 2),
graph optimization level (4), execution mode (2), precision; models: ReLU MLPs of four sizes.

The source model (boosted trees) learns from every source measurement; each seed draws n target
measurements, fits every target learner on them, and scores MAPE on the other target measurements.
Goal: at 10 target samples a transfer learner's MAPE at most half of the best from-scratch learner's.

    .venv/bin/python bench/perfmodel_transfer.py               # measures (a few minutes), then learns
    .venv/bin/python bench/perfmodel_transfer.py --reuse       # learns again on the cached measurements
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from sklearn.model_selection import KFold, cross_val_predict

from opml_common.perfmodel import (
    FromScratch,
    InfluenceTransfer,
    ModelShift,
    PerformanceModel,
    Sample,
    ScaleShift,
    ServingConfig,
    grid,
    influential_terms,
    mape,
)
from opml_common.perfmodel.learn import tree_learner
from opml_common.perfmodel.space import encode
from opml_inference_router.placement import Fleet, ModelDemand, ModelVersion, Profile, ProfileBook, ProfilePredictor
from opml_inference_router.placement.fleet_config import load_fleet_config
from opml_inference_router.runtime.perfsample import measure
from opml_inference_router.settings import LOCAL_FLEET
from opml_inference_router.testing.models import mlp_classifier, mlp_config
from opml_inference_router_contract.model_config import ModelConfig

MODELS = {"mlp-w64-d2": (64, 2), "mlp-w256-d2": (256, 2), "mlp-w1024-d2": (1024, 2), "mlp-w2048-d3": (2048, 3)}
BATCHES = (1, 2, 4, 8, 16, 32)
THREADS = (1, 2)
SIZES = (5, 10, 20)
CACHE = Path(tempfile.gettempdir()) / "opml-bench" / "perfmodel_transfer.json"


def measure_all(runs: int, passes: int) -> dict[str, list[Sample]]:
    """Every source and target configuration of every model. Each model's kinds are measured in
    alternating passes (cpu, accel, cpu, ...), each configuration keeping its lowest pass, so both
    kinds see the same spells of load from the machine's other processes."""
    fleet = load_fleet_config(LOCAL_FLEET)
    kinds = {kind.name: kind for kind in fleet.pool_kinds}
    plans = {"cpu": (kinds["cpu"].model_copy(update={"precisions": ("fp32", "int8")}),
                     list(grid(batches=BATCHES, threads=THREADS))),
             "accel": (kinds["accel"], list(grid(batches=BATCHES, threads=THREADS, precisions=("int8",))))}
    out: dict[str, list[Sample]] = {"cpu": [], "accel": []}
    with tempfile.TemporaryDirectory(prefix="opml-perfmodel-") as scratch:
        for name, (width, depth) in MODELS.items():
            path = Path(scratch) / f"{name}.onnx"
            onnx.save(mlp_classifier(features=64, width=width, depth=depth), path)
            config = ModelConfig.from_dict(mlp_config(name, features=64))
            started = time.perf_counter()
            best: dict[str, list[Sample]] = {}
            for _ in range(passes):
                for kind_name, (kind, configs) in plans.items():
                    samples = measure(path, config, kind, configs, runs=runs, passes=1)
                    best[kind_name] = [min(pair, key=lambda s: s.latency_ms)
                                       for pair in zip(best.get(kind_name, samples), samples, strict=True)]
            for kind_name in plans:
                out[kind_name] += best[kind_name]
            print(f"  measured {name} on cpu and accel in {time.perf_counter() - started:.0f} s", flush=True)
    return out


def to_json(data: dict[str, list[Sample]]) -> dict:
    return {kind: [{"model": s.model, "mflop_per_row": s.mflop_per_row, "latency_ms": s.latency_ms,
                    **vars(s.config)} for s in samples] for kind, samples in data.items()}


def from_json(data: dict) -> dict[str, list[Sample]]:
    return {kind: [Sample(row["model"], row["mflop_per_row"],
                          ServingConfig(row["batch"], row["threads"], row["opt_level"], row["execution_mode"],
                                        row["precision"]), row["latency_ms"]) for row in rows]
            for kind, rows in data.items()}


def learners(source: PerformanceModel, terms, seed: int) -> list:
    return [ModelShift(source), ScaleShift(source), InfluenceTransfer(source, terms), FromScratch("trees", seed=seed),
            FromScratch("linear")]


def report(data: dict[str, list[Sample]], seeds: int) -> bool:
    """Prints the influences and the MAPE table; True when the goal is met."""
    source_samples, target_samples = data["cpu"], data["accel"]
    source = PerformanceModel(environment="cpu").fit(source_samples)
    terms = influential_terms(source_samples, top=6)
    print("\nsource (cpu) option importances (trees):",
          ", ".join(f"{k} {v:.2f}" for k, v in source.option_importances().items()))
    print("source influential terms (Lasso, log-latency weight per std):",
          ", ".join(f"{t.term} {t.weight:+.2f}" for t in terms))
    print("target influential terms, from all its measurements (for comparison):",
          ", ".join(f"{t.term} {t.weight:+.2f}" for t in influential_terms(target_samples, top=6)))
    actual_all = np.array([s.latency_ms for s in target_samples])
    print(f"source model used as is on the target: MAPE {mape(source.predict_ms(target_samples), actual_all):.1f}%")
    folds = KFold(5, shuffle=True, random_state=0)
    floor = cross_val_predict(tree_learner(), encode(target_samples), np.log(actual_all), cv=folds)
    print(f"target learnt from all {len(target_samples)} of its measurements (5-fold CV; what noise leaves): "
          f"MAPE {mape(np.exp(floor), actual_all):.1f}%")

    latency: dict[tuple[str, int], list[float]] = {}
    throughput: dict[tuple[str, int], list[float]] = {}
    for n in SIZES:
        for seed in range(seeds):
            chosen = set(np.random.default_rng(seed).choice(len(target_samples), size=n, replace=False).tolist())
            train = [s for i, s in enumerate(target_samples) if i in chosen]
            test = [s for i, s in enumerate(target_samples) if i not in chosen]
            actual = np.array([s.latency_ms for s in test])
            batch = np.array([s.config.batch for s in test])
            for learner in learners(source, terms, seed):
                predicted = learner.fit(train).predict_ms(test)
                latency.setdefault((learner.name, n), []).append(mape(predicted, actual))
                throughput.setdefault((learner.name, n), []).append(mape(batch / predicted, batch / actual))

    names = [learner.name for learner in learners(source, terms, 0)]
    print(f"\nlatency MAPE % on the held-out target measurements, mean (sd) over {seeds} seeds:")
    print(f"{'learner':<20}" + "".join(f"{f'n={n}':>16}" for n in SIZES))
    for name in names:
        print(f"{name:<20}" + "".join(f"{statistics.fmean(latency[name, n]):>9.1f} ({statistics.pstdev(latency[name, n]):4.1f})"
                                      for n in SIZES))
    print("throughput MAPE % (rows/s of one replica), mean:")
    for name in names:
        print(f"{name:<20}" + "".join(f"{statistics.fmean(throughput[name, n]):>16.1f}" for n in SIZES))
    met = False
    for n in SIZES:
        scratch = min(statistics.fmean(latency[name, n]) for name in names if name.startswith("scratch"))
        ratios = {name: statistics.fmean(latency[name, n]) / scratch for name in names if not name.startswith("scratch")}
        print(f"n={n}: transfer MAPE / best scratch MAPE: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
        met = met or (n == 10 and min(ratios.values()) <= 0.5)
    print(f"goal (a transfer learner at most half the best scratch MAPE at n=10): {'met' if met else 'NOT met'}")
    return met


def router_check(data: dict[str, list[Sample]]) -> None:
    """What the router's ProfilePredictor does with these measurements: each model's accel profile
    (int8, at the kind's shapes) predicted from its cpu profile (fp32) and the other models' two
    profiles, with the worker's own options (threads 1 as on this machine, level all, sequential)."""
    fleet = Fleet(load_fleet_config(LOCAL_FLEET))
    default = {"threads": 1, "opt_level": "all", "execution_mode": "sequential"}

    def profile(kind: str, name: str, precision: str) -> Profile:
        points = sorted((s.config.batch, s.latency_ms) for s in data[kind] if s.model == name and
                        s.config.precision == precision and all(getattr(s.config, k) == v for k, v in default.items())
                        and (kind == "cpu" or s.config.batch in fleet.kinds[kind].batch_sizes))
        running, table = 0.0, {}
        for batch, ms in points:
            running = table[batch] = max(running, ms)
        return Profile(ModelVersion(name, 1), kind, precision, table, 100.0)

    errors, as_is = [], []
    for name in MODELS:
        book = ProfileBook([profile("cpu", other, "fp32") for other in MODELS] +
                           [profile("accel", other, "int8") for other in MODELS if other != name])
        config = ModelConfig.from_dict(mlp_config(name, features=64, pool_kinds=("cpu", "accel")))
        predicted = ProfilePredictor(fleet=fleet).predict(ModelDemand(config, 1, 1.0), fleet.kinds["accel"], book)
        actual = profile("accel", name, "int8")
        sizes = sorted(actual.batch_latency_ms)
        truth = np.array([actual.latency_ms(b) for b in sizes])
        errors.append(mape(np.array([predicted.latency_ms(b) for b in sizes]), truth))
        as_is.append(mape(np.array([book.get(ModelVersion(name, 1), "cpu").latency_ms(b) for b in sizes]), truth))
    print(f"\nrouter ProfilePredictor, accel profile of each model from its cpu profile and the other "
          f"{len(MODELS) - 1} models (MAPE % at batch 1, 8, 32): " + ", ".join(
              f"{name} {e:.1f}" for name, e in zip(MODELS, errors, strict=True)) +
          f"; mean {statistics.fmean(errors):.1f} (the cpu fp32 profile taken as is: {statistics.fmean(as_is):.1f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--runs", type=int, default=15, help="timed batches per configuration and pass (median)")
    parser.add_argument("--passes", type=int, default=3, help="passes per kind (lowest median kept)")
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--reuse", action="store_true", help="learn on the cached measurements instead of measuring")
    args = parser.parse_args()

    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
    if args.reuse:
        data = from_json(json.loads(args.cache.read_text()))
        print(f"measurements: reused {args.cache}")
    else:
        started = time.perf_counter()
        data = measure_all(args.runs, args.passes)
        args.cache.parent.mkdir(parents=True, exist_ok=True)
        args.cache.write_text(json.dumps(to_json(data)))
        print(f"measurements: {sum(map(len, data.values()))} in {time.perf_counter() - started:.0f} s, "
              f"cached in {args.cache}")
    report(data, args.seeds)
    router_check(data)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
