"""Time-to-accuracy of federated client selection under heterogeneity (TiFL's claim), in the
fl-coordinator's simulator: the service's own Federation, strategies and selection code, driven
in virtual time by ``--clients`` virtual clients on scikit-learn's digits.

Heterogeneity: TiFL's five CPU-share groups (4, 2, 1, 0.5, 0.1 x ``--base-speed`` examples per
second), log-normal upload delays, a ``--dropout`` chance per task of never answering (the round's
deadline drops it); Dirichlet(``--alpha``) label skew and log-normal shard sizes. Same data, same
clients, same model (softmax regression), same local training for every policy:

  random     FedAvg with uniform random selection (Flower's FedAvg): the baseline
  tifl       TiFL's adaptive tier selection (tiers by profiled round time, tier probabilities
             from per-tier accuracy, credits)
  semi_async buffered semi-asynchronous aggregation (FedBuff-like: ``--buffer`` updates per
             version from ``--concurrency`` clients training at once, staleness-damped)

For each seed it reports virtual seconds and rounds until the server-side test accuracy first
reaches ``--target``, and the final accuracy; then the mean over seeds and each policy's speed-up
over random selection measured in the same run (ratio of virtual times; > 1 is faster).

    .venv/bin/python bench/fl_coordinator_tiers.py                       # 3 seeds, 200 clients
    .venv/bin/python bench/fl_coordinator_tiers.py --clients 100 --rounds 150 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from opml_fl_coordinator.config import parse_config
from opml_fl_coordinator.simulator import Simulator, heterogeneous_traits, partition_digits

POLICIES = ("random", "tifl", "semi_async")


def config(policy: str, args: argparse.Namespace) -> dict:
    document = {
        "name": "bench", "rounds": args.rounds if policy != "semi_async" else args.rounds * args.async_factor,
        "min_clients": args.clients, "round_deadline_s": args.deadline, "seed": args.seed,
        "target_accuracy": args.target if args.stop_at_target else None,
        "selection": {"policy": "tifl" if policy == "tifl" else "random", "clients_per_round": args.per_round,
                      "tiers": 5, "tier_interval": args.tier_interval, "credits_per_tier": args.credits},
        "local": {"epochs": args.epochs, "batch_size": 16, "learning_rate": args.lr},
        "mode": "semi_async" if policy == "semi_async" else "sync",
        "semi_async": {"buffer_size": args.buffer, "concurrency": args.concurrency, "staleness_exponent": 0.5,
                       "max_staleness": 20},
        "trust": "trusted",  # the policies compared on plain aggregation, as the published results were
    }
    return {k: v for k, v in document.items() if v is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=150, help="sync rounds (semi-async: x --async-factor versions)")
    parser.add_argument("--async-factor", type=int, default=2)
    parser.add_argument("--buffer", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--deadline", type=float, default=30.0)
    parser.add_argument("--base-speed", type=float, default=20.0)
    parser.add_argument("--dropout", type=float, default=0.02)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--tier-interval", type=int, default=5)
    parser.add_argument("--credits", type=int, default=None)
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--stop-at-target", action="store_true", help="end each run at the target")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    policies = args.policies.split(",")
    rows = []
    for seed in seeds:
        args.seed = seed
        partition = partition_digits(args.clients, alpha=args.alpha, seed=seed)
        traits = heterogeneous_traits(args.clients, seed=seed, base_speed=args.base_speed, dropout=args.dropout)
        for policy in policies:
            started = time.perf_counter()
            result = Simulator(parse_config(config(policy, args)), partition, traits, seed=seed).run()
            reached = result.time_to(args.target)
            rows.append({"seed": seed, "policy": policy, "virtual_s": reached[0] if reached else None,
                         "rounds": reached[1] if reached else None, "final_accuracy": result.accuracy[-1],
                         "best_accuracy": max(result.accuracy), "total_virtual_s": result.times[-1],
                         "wall_s": time.perf_counter() - started})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{args.clients} clients, {args.per_round} per round, deadline {args.deadline:g} s, target accuracy "
          f"{args.target:g}, seeds {seeds}")
    print(f"{'seed':>4} {'policy':<11} {'time to target (virtual s)':>27} {'rounds':>7} {'final acc':>10} "
          f"{'best acc':>9} {'wall s':>7}")
    for row in rows:
        tt = f"{row['virtual_s']:.0f}" if row["virtual_s"] is not None else "not reached"
        rounds = str(row["rounds"]) if row["rounds"] is not None else "-"
        print(f"{row['seed']:>4} {row['policy']:<11} {tt:>27} {rounds:>7} {row['final_accuracy']:>10.3f} "
              f"{row['best_accuracy']:>9.3f} {row['wall_s']:>7.2f}")
    print("\nmean over seeds (speed-up: random's time to target / the policy's, per seed, then mean)")
    for policy in policies:
        mine = [r for r in rows if r["policy"] == policy]
        times = [r["virtual_s"] for r in mine if r["virtual_s"] is not None]
        speedups = []
        for r in mine:
            base = next(b for b in rows if b["policy"] == "random" and b["seed"] == r["seed"])
            if r["virtual_s"] and base["virtual_s"]:
                speedups.append(base["virtual_s"] / r["virtual_s"])
        print(f"  {policy:<11} reached {len(times)}/{len(mine)}, time to target "
              f"{statistics.mean(times) if times else float('nan'):.0f} s, final accuracy "
              f"{statistics.mean(r['final_accuracy'] for r in mine):.3f}, speed-up vs random "
              + (f"{statistics.mean(speedups):.2f}x" if speedups else "n/a"))


if __name__ == "__main__":
    main()
