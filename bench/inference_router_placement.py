"""Inference-router placement benchmark: the cost-aware SLO planner against greedy first-fit.

For each seed, a synthetic fleet (``--workers`` workers: 60% cpu, 20% gpu, 20% FPGA-style accel)
and ``--models`` models with Zipf-distributed rates (``--rate`` requests/s in total) are placed by
both policies through the same :class:`Planner`, from *measured* (noisy) profiles. Every placed
model is then checked by a discrete-event simulation of one replica running its *true* profile
with per-batch jitter (``--requests`` requests each); a model meets its SLO when the simulated p99
is within it. Then the world drifts under the planner's plan (10% of models: rate x4, rate x0.25
or 2x slower), the Replanner re-places from the simulated measurements, every move is checked to
keep capacity, and the new plan is simulated. Last, a sweep of the planner's SLO headroom on the
first seed.

    .venv/bin/python bench/inference_router_placement.py                 # 1,000 models, 200 workers, seeds 1-3
    .venv/bin/python bench/inference_router_placement.py --seeds 1 --models 200 --workers 40 --rate 20000
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

from opml_inference_router.placement import CostAwareSloPolicy, GreedyFirstFitPolicy
from opml_inference_router.sim import Evaluation, evaluate, replacement_round, synthetic_workload

KINDS = ("cpu", "gpu", "accel")


def per_kind(values: dict[str, float], fmt: str) -> str:
    return " / ".join(format(values[kind], fmt) for kind in KINDS)


def belief_ratio(evaluation: Evaluation) -> float:
    """Median of predicted p99 over simulated p99 across placed models (> 1: the planner is cautious)."""
    ratios = [o.predicted_p99_ms / o.measured_p99_ms for o in evaluation.outcomes if o.predicted_p99_ms]
    return statistics.median(ratios)


def row(seed: int, e: Evaluation) -> str:
    slots = {kind: e.usage[kind].slot_utilization * 100 for kind in KINDS}
    busy = {kind: e.busy(kind) * 100 for kind in KINDS}
    return (f"| {seed} | {e.policy} | {e.slo_attainment:.1%} | {e.traffic_attainment:.1%} | {len(e.plan.unplaced)} "
            f"| {e.cost_per_hour:.1f} | {e.active_cost_per_hour:.1f} "
            f"| {per_kind(slots, '.0f')} | {per_kind(busy, '.0f')} "
            f"| {belief_ratio(e):.2f} | {e.planning_s:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=200)
    parser.add_argument("--rate", type=float, default=100_000.0, help="total requests/s over all models")
    parser.add_argument("--requests", type=int, default=3000, help="simulated requests per model")
    parser.add_argument("--headrooms", type=float, nargs="*", default=[0.7, 0.8, 0.9, 1.0])
    args = parser.parse_args()
    started = time.perf_counter()
    print(f"# inference-router placement: {args.models} models, {args.workers} workers, {args.rate:g} rps total, "
          f"{args.requests} simulated requests per model")
    print(f"# python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} cpus\n")

    print("| seed | policy | SLO met (models) | SLO met (traffic) | unplaced | cost/h (replicas) "
          "| cost/h (busy workers) | slots used % cpu/gpu/accel | replica busy % cpu/gpu/accel "
          "| predicted/simulated p99 (median) | plan s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    results: dict[str, list[Evaluation]] = {"planner": [], "greedy": []}
    replacements = []
    for seed in args.seeds:
        workload = synthetic_workload(seed=seed, models=args.models, workers=args.workers, total_rate_rps=args.rate)
        planner = evaluate("planner", CostAwareSloPolicy(), workload, seed=seed, requests=args.requests)
        greedy = evaluate("greedy", GreedyFirstFitPolicy(), workload, seed=seed, requests=args.requests)
        results["planner"].append(planner)
        results["greedy"].append(greedy)
        print(row(seed, planner))
        print(row(seed, greedy), flush=True)
        replacements.append((seed, replacement_round(workload, CostAwareSloPolicy(), planner.plan, seed=seed,
                                                     requests=args.requests)))

    def mean(policy: str, metric) -> float:
        return statistics.mean(metric(e) for e in results[policy])

    print(f"\nMean over seeds {', '.join(map(str, args.seeds))}:\n")
    print("| metric | planner | greedy first-fit | planner / greedy |")
    print("|---|---|---|---|")
    for label, metric, fmt in [
        ("SLO met (models)", lambda e: e.slo_attainment, ".1%"),
        ("SLO met (traffic)", lambda e: e.traffic_attainment, ".1%"),
        ("cost/h (replicas)", lambda e: e.cost_per_hour, ".1f"),
        ("cost/h (busy workers)", lambda e: e.active_cost_per_hour, ".1f"),
        ("planning time s", lambda e: e.planning_s, ".2f"),
    ]:
        ours, theirs = mean("planner", metric), mean("greedy", metric)
        print(f"| {label} | {ours:{fmt}} | {theirs:{fmt}} | {ours / theirs:.2f} |")

    print("\nRe-placement after drift (planner; 10% of models: rate x4, rate x0.25, or 2x slower than profiled):\n")
    print("| seed | models drifted | models moved | replicas added / removed | SLO met before -> after "
          "| cost/h before -> after | replan s |")
    print("|---|---|---|---|---|---|---|")
    for seed, r in replacements:
        print(f"| {seed} | {r.drifted} | {r.moved} | {r.adds} / {r.removes} | {r.attainment_before:.1%} -> "
              f"{r.attainment_after:.1%} | {r.cost_before:.1f} -> {r.cost_after:.1f} | {r.replanning_s:.2f} |")

    if args.headrooms:
        seed = args.seeds[0]
        workload = synthetic_workload(seed=seed, models=args.models, workers=args.workers, total_rate_rps=args.rate)
        print(f"\nPlanner SLO headroom (plans for p99 <= headroom x SLO), seed {seed}:\n")
        print("| headroom | SLO met (models) | SLO met (traffic) | unplaced | cost/h (replicas) |")
        print("|---|---|---|---|---|")
        for headroom in args.headrooms:
            e = evaluate(f"{headroom}", CostAwareSloPolicy(slo_headroom=headroom), workload, seed=seed,
                         requests=args.requests)
            print(f"| {headroom:g} | {e.slo_attainment:.1%} | {e.traffic_attainment:.1%} | {len(e.plan.unplaced)} "
                  f"| {e.cost_per_hour:.1f} |", flush=True)
    print(f"\n# total {time.perf_counter() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
