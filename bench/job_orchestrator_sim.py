"""Job-orchestrator benchmark: TE/BE scheduling policies in the discrete-event simulator, and the
scheduler's decision rate with 10,000 queued jobs.

Part 1 runs every policy on the same synthetic workloads (one per seed; see
opml_job_orchestrator.simulator.workload for the assumptions) and prints TE and BE slowdown
percentiles (mean ± standard deviation across seeds) and their change against FIFO, computed per
seed, beside the numbers of Yabuuchi et al. (OpML '19): TE p95 -96.6%, BE p50 +18.0%, BE p95 +23.9%.

Part 2 fills the scheduler's queue with ``--queued`` jobs of the same mix on the same cluster, then
repeats: one running job finishes, one new job arrives, one scheduling pass. It reports passes and
decisions (starts + preemptions) per second of scheduler time.

    .venv/bin/python bench/job_orchestrator_sim.py                        # 5 seeds x 20,000 jobs
    .venv/bin/python bench/job_orchestrator_sim.py --seeds 2 --jobs 4000 --rounds 500   # quick
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from opml_job_orchestrator.scheduler import POLICY_PRESETS, Cluster, JobClass, Scheduler
from opml_job_orchestrator.simulator import (
    RunSummary,
    WorkloadConfig,
    compare,
    format_table,
    generate_workload,
    simulate,
    summarize,
)


def run_one(config: WorkloadConfig, policy: str, seed: int) -> tuple[RunSummary, float]:
    jobs = generate_workload(config, seed)
    started = time.perf_counter()
    result = simulate(jobs, config.node_specs(), POLICY_PRESETS[policy]())
    return summarize(result, seed=seed), time.perf_counter() - started


def decision_rate(config: WorkloadConfig, policy: str, *, queued: int, rounds: int, seed: int) -> dict[str, float]:
    """Scheduler time per pass with ``queued`` jobs waiting, under steady churn."""
    stream = iter(generate_workload(dataclasses.replace(config, num_jobs=queued + rounds + 1), seed))
    scheduler = Scheduler(Cluster(config.node_specs()), POLICY_PRESETS[policy]())
    rng = random.Random(seed)
    now = 0.0
    for _ in range(queued):
        scheduler.submit(next(stream).spec, now=now)
    scheduler.schedule(now=now)
    latencies: list[float] = []
    decisions = 0
    for _ in range(rounds):
        now += 1.0
        arrival = next(stream).spec
        finishing = rng.choice(list(scheduler.running))
        started = time.perf_counter()
        scheduler.finish(finishing, now=now)
        scheduler.submit(arrival, now=now)
        decisions += len(scheduler.schedule(now=now))
        latencies.append(time.perf_counter() - started)
    total = sum(latencies)
    return {"queued": scheduler.pending_count, "passes_per_s": rounds / total, "decisions_per_s": decisions / total,
            "mean_ms": 1000 * statistics.fmean(latencies),
            "p99_ms": 1000 * sorted(latencies)[int(0.99 * (len(latencies) - 1))]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5, help="workloads (seeds 0..N-1), default 5")
    parser.add_argument("--jobs", type=int, default=20_000, help="jobs per workload, default 20000")
    parser.add_argument("--load", type=float, default=WorkloadConfig().load, help="offered GPU load")
    parser.add_argument("--te-share", type=float, default=WorkloadConfig().te_load_share,
                        help="share of the GPU load from TE jobs")
    parser.add_argument("--policies", default=",".join(POLICY_PRESETS),
                        help=f"comma-separated, from {', '.join(POLICY_PRESETS)}; the first is the baseline")
    parser.add_argument("--queued", type=int, default=10_000, help="queue length for the decision rate")
    parser.add_argument("--rounds", type=int, default=2_000, help="passes timed for the decision rate")
    parser.add_argument("--rate-nodes", default="16,128",
                        help="cluster sizes (nodes of 8 GPUs) for the decision rate, default 16,128")
    parser.add_argument("--workers", type=int, default=2, help="processes for the simulations")
    args = parser.parse_args()
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in POLICY_PRESETS]
    if unknown:
        parser.error(f"unknown policies {unknown}; choose from {list(POLICY_PRESETS)}")
    config = WorkloadConfig(num_jobs=args.jobs, load=args.load, te_load_share=args.te_share)
    te_rate, be_rate = config.arrival_rates()
    sample = [job for job in generate_workload(config, 0) if job.measured]
    be_measured = sum(job.spec.job_class is JobClass.BE for job in sample)
    print(f"# job-orchestrator simulation: {config.nodes} nodes x {config.gpus_per_node} GPUs, {args.jobs} jobs "
          f"per seed, load {config.load}, TE share {config.te_load_share}, seeds 0..{args.seeds - 1}")
    print(f"# arrivals: {te_rate * 86400:.0f} TE/day, {be_rate * 86400:.1f} BE/day; measured (seed 0): "
          f"{len(sample) - be_measured} TE, {be_measured} BE jobs over {sample[-1].submit_time / 86400:.0f} days; "
          f"{platform.python_implementation()} {platform.python_version()} on {platform.machine()}")

    started = time.perf_counter()
    tasks = [(policy, seed) for seed in range(args.seeds) for policy in policies]
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = [pool.submit(run_one, config, policy, seed) for policy, seed in tasks]
        results = [future.result() for future in futures]
    sim_seconds = [seconds for _, seconds in results]
    print(f"# {len(tasks)} simulations in {time.perf_counter() - started:.0f} s "
          f"({statistics.fmean(sim_seconds):.1f} s each)\n")
    print(format_table(compare([summary for summary, _ in results], baseline=policies[0]), baseline=policies[0]))

    print(f"\n## decision rate: {args.queued} queued jobs, {args.rounds} passes (1 finish + 1 arrival each)\n")
    print("| policy | nodes | queued | passes/s | decisions/s | mean pass ms | p99 pass ms |")
    print("|---|---|---|---|---|---|---|")
    for nodes in (int(n) for n in args.rate_nodes.split(",")):
        for policy in policies:
            rate = decision_rate(dataclasses.replace(config, nodes=nodes), policy, queued=args.queued,
                                 rounds=args.rounds, seed=0)
            print(f"| {policy} | {nodes} | {rate['queued']:.0f} | {rate['passes_per_s']:.0f} "
                  f"| {rate['decisions_per_s']:.0f} | {rate['mean_ms']:.2f} | {rate['p99_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
