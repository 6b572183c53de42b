"""fl-coordinator against Flower 1.42's own FedAvg simulation, on the same data, model, local
training, clients per round and target accuracy, under the same resource heterogeneity.

Both sides: scikit-learn's digits split over ``--clients`` clients (Dirichlet label skew, unequal
sizes, bench seed), softmax regression trained by the same numpy code, ``--per-round`` clients per
round, ``--epochs`` local epochs, server-side test accuracy after every round. Heterogeneity: each
client needs ``examples / speed + delay`` seconds (TiFL's five speed groups, as the simulator's
``heterogeneous_traits``, no drop-outs: Flower's FedAvg waits for every sampled client).

  Flower     ``flwr.simulation.run_simulation`` (Ray backend, .venv-peers-flower created from
             bench/requirements-peers-flower.txt when missing) with Flower's ``FedAvg``; each client
             really sleeps its time x ``--time-scale``, so the round waits for its slowest client
             as on real devices. Its time to target is measured wall time from round 1's start.
  ours       the fl-coordinator's simulator (the service's Federation and strategies) with random
             FedAvg, TiFL and semi-async; time to target is virtual time x ``--time-scale`` (the
             same clock as Flower's sleeps), and the simulator's own wall time is shown beside.

    .venv/bin/python bench/fl_coordinator_flower.py
    .venv/bin/python bench/fl_coordinator_flower.py --clients 100 --rounds 40 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import numpy as np
import yaml
from _stack import bench_services

from opml_devstack.testing.services import TOKENS
from opml_fl_coordinator.config import parse_config
from opml_fl_coordinator.simulator import Simulator, SoftmaxModel, heterogeneous_traits, partition_digits
from opml_fl_coordinator_contract.client import FederationClient, NumPyClient, run_client

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-peers-flower"


def flower_python() -> Path:
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-r",
                        str(ROOT / "bench" / "requirements-peers-flower.txt")], check=True)
    return python


def federation(policy: str, args, seed: int, name: str = "bench") -> dict:
    """The federation config of one policy, the same for the simulator and the service."""
    return {"name": name, "rounds": args.rounds * (2 if policy == "semi_async" else 1),
                "min_clients": args.clients, "round_deadline_s": 86400, "seed": seed,
                "selection": {"policy": "tifl" if policy == "tifl" else "random",
                              "clients_per_round": args.per_round, "tiers": 5, "tier_interval": 5},
                "local": {"epochs": args.epochs, "batch_size": 16, "learning_rate": args.lr},
                "mode": "semi_async" if policy == "semi_async" else "sync",
                "semi_async": {"buffer_size": args.per_round, "concurrency": 2 * args.per_round,
                               "max_staleness": 20},
                "trust": "trusted"}  # aggregation as Flower's FedAvg: no bound on each update's influence


def ours(policy: str, args, partition, traits, seed: int):
    result = Simulator(parse_config(federation(policy, args, seed)), partition, traits, seed=seed).run()
    reached = result.time_to(args.target)
    wall = result.time_to(args.target, wall=True)
    return {"time_s": reached[0] * args.time_scale if reached else None, "rounds": reached[1] if reached else None,
            "engine_wall_s": wall[0] if wall else None, "final_accuracy": result.accuracy[-1]}


class SleepingMember(NumPyClient):
    """One client of the partition: trains as Flower's do, then sleeps ``(examples / speed + delay) x
    time_scale`` (its device's time). It also evaluates the model it is sent on its own data (a
    forward pass, well under a millisecond), as the SDK asks before each fit: TiFL ranks tiers by
    that accuracy (without it every tier ranks alike and TiFL degenerates to favouring the fastest)."""

    def __init__(self, index: int, partition, traits, args, seed: int) -> None:
        self.x, self.y = partition.clients[index]
        self.model = SoftmaxModel(self.x.shape[1], partition.classes)
        self.speed, self.delay_s = traits[index].speed, traits[index].delay_s
        self.time_scale = args.time_scale
        self.rng = np.random.default_rng([seed, index])
        self.stop = threading.Event()

    def num_examples(self):
        return len(self.y)

    def get_weights(self, config):
        return self.model.initial_weights()

    def evaluate(self, weights, config):
        loss, accuracy = self.model.evaluate(weights, self.x, self.y)
        return loss, len(self.y), {"accuracy": accuracy}

    def fit(self, weights, config):
        trained, done = self.model.fit(weights, self.x, self.y, epochs=int(config["epochs"]),
                                       batch_size=int(config["batch_size"]),
                                       learning_rate=float(config["learning_rate"]), rng=self.rng)
        self.stop.wait((done / self.speed + self.delay_s) * self.time_scale)
        return trained, done, {}


def service(policy: str, args, partition, traits, seed: int, coordinator: str):
    """One federation on the running coordinator with ``--clients`` sleeping members; wall times."""
    name = f"bench-{policy.replace('_', '-')}-{seed}-{uuid.uuid4().hex[:6]}"
    members = [SleepingMember(i, partition, traits, args, seed) for i in range(args.clients)]
    with FederationClient(coordinator, token=TOKENS["writer"]) as writer:
        writer.create(yaml.safe_dump(federation(policy, args, seed, name=name)))
        tokens = [writer.register_client(name, f"c{i:03d}").token for i in range(args.clients)]
        threads = [threading.Thread(target=run_client, args=(coordinator, name, token, member),
                                    kwargs={"token": TOKENS["reader"], "wait_s": 5.0}, daemon=True)
                   for token, member in zip(tokens, members, strict=True)]
        for thread in threads:
            thread.start()
        model, (x_test, y_test) = SoftmaxModel(partition.test[0].shape[1], partition.classes), partition.test
        history, first_start = [], None
        try:
            for record in writer.watch(name):  # each round as it completes, until the federation ends
                first_start = first_start if first_start is not None else record.start_time.ToNanoseconds() / 1e9
                accuracy = model.evaluate(writer.weights(name), x_test, y_test)[1]
                history.append((record.number, record.end_time.ToNanoseconds() / 1e9 - first_start, accuracy))
        finally:
            for member in members:
                member.stop.set()
        for thread in threads:
            thread.join(timeout=60)
    reached = next(((r, t) for r, t, a in history if a >= args.target), None)
    return {"time_s": reached[1] if reached else None, "rounds": reached[0] if reached else None,
            "engine_wall_s": reached[1] if reached else None, "final_accuracy": history[-1][2]}


def flower(args, traits, seed: int, cpus_per_client: float):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump([[t.speed, t.delay_s] for t in traits], handle)
    command = [str(flower_python()), str(ROOT / "bench" / "_flower_peer.py"), "--clients", str(args.clients),
               "--per-round", str(args.per_round), "--rounds", str(args.rounds), "--epochs", str(args.epochs),
               "--lr", str(args.lr), "--alpha", str(args.alpha), "--seed", str(seed), "--time-scale",
               str(args.time_scale), "--traits", handle.name, "--cpus-per-client", str(cpus_per_client)]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    report = json.loads(out.strip().splitlines()[-1])
    history = [(r, t, a) for r, t, a in report["history"] if r > 0]
    reached = next(((r, t) for r, t, a in history if a >= args.target), None)
    return {"time_s": reached[1] if reached else None, "rounds": reached[0] if reached else None,
            "engine_wall_s": reached[1] if reached else None, "final_accuracy": history[-1][2],
            "total_wall_s": report["total_wall_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--base-speed", type=float, default=20.0)
    parser.add_argument("--time-scale", type=float, default=0.05, help="real seconds per virtual second")
    parser.add_argument("--flower-cpus", default="0.1,0.2,0.5,1", help="Ray CPUs per Flower client, each tried "
                        "on the first seed (below 1 lets a round's sleeping clients run side by side)")
    parser.add_argument("--systems", default="flower,service,sim", help="any of flower, service, sim")
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()
    systems = set(args.systems.split(","))
    settings = [float(c) for c in args.flower_cpus.split(",")]
    rows = []
    with bench_services() as (starter, _):
        coordinator = starter("fl-coordinator").target if "service" in systems else ""
        for seed in [int(s) for s in args.seeds.split(",")]:
            partition = partition_digits(args.clients, alpha=args.alpha, seed=seed)
            traits = heterogeneous_traits(args.clients, seed=seed, base_speed=args.base_speed, dropout=0.0)
            if "flower" in systems:
                tried = [{"seed": seed, "system": f"Flower 1.42 FedAvg cpus={c:g}", "cpus": c,
                          **flower(args, traits, seed, c)} for c in settings]
                rows.extend(tried)
                settings = [min(tried, key=lambda r: r["time_s"] or float("inf"))["cpus"]]
            if "service" in systems:
                for policy in ("random", "tifl", "semi_async"):
                    rows.append({"seed": seed, "system": f"ours (service) {policy}",
                                 **service(policy, args, partition, traits, seed, coordinator)})
            if "sim" in systems:
                for policy in ("random", "tifl", "semi_async"):
                    rows.append({"seed": seed, "system": f"ours (sim) {policy}",
                                 **ours(policy, args, partition, traits, seed)})
    print(f"{args.clients} clients, {args.per_round} per round, target accuracy {args.target:g}, time scale "
          f"{args.time_scale:g} real s per virtual s")
    print(f"{'seed':>4} {'system':<32} {'time to target s':>17} {'rounds':>7} {'final acc':>10} {'engine wall s':>14}")
    for r in rows:
        fmt = lambda v, f: f.format(v) if v is not None else "-"  # noqa: E731
        print(f"{r['seed']:>4} {r['system']:<32} {fmt(r['time_s'], '{:.2f}'):>17} {fmt(r['rounds'], '{}'):>7} "
              f"{r['final_accuracy']:>10.3f} {fmt(r['engine_wall_s'], '{:.2f}'):>14}")
    print("\nmean over seeds; ratio: Flower's time to target (at its best setting on that seed) / the system's "
          "(> 1: faster than Flower)")
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system]
        ratios = []
        for r in mine:
            flowers = [b for b in rows if b["system"].startswith("Flower") and b["seed"] == r["seed"]]
            if not flowers:
                continue
            base = min(flowers, key=lambda b: b["time_s"] or float("inf"))
            if r["time_s"] and base["time_s"]:
                ratios.append(base["time_s"] / r["time_s"])
        times = [r["time_s"] for r in mine if r["time_s"]]
        rounds = [r["rounds"] for r in mine if r["rounds"]]
        print(f"  {system:<32} reached {len(times)}/{len(mine)}, time {statistics.mean(times) if times else float('nan'):.2f} s, "
              f"rounds {statistics.mean(rounds) if rounds else float('nan'):.1f}, final accuracy "
              f"{statistics.mean(r['final_accuracy'] for r in mine):.3f}, vs Flower "
              + (f"{statistics.mean(ratios):.2f}x" if ratios else "n/a"))


if __name__ == "__main__":
    main()
