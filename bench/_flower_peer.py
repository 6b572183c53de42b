"""Flower 1.42's own FedAvg simulation (Ray backend) on the fl-coordinator bench's data and model;
run by bench/fl_coordinator_flower.py inside .venv-peers-flower. Prints one JSON document: the
wall time from the simulation's start and the server-side test accuracy after every round."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np

SRC = Path(__file__).resolve().parents[1] / "services" / "fl-coordinator" / "src"
sys.path.insert(0, str(SRC))  # opml_fl_coordinator's package and weights modules are numpy only


def _load(name: str, path: Path):
    """One module of the simulator by path (its package __init__ imports the service's config)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


data = _load("fl_data", SRC / "opml_fl_coordinator" / "simulator" / "data.py")
model_module = _load("fl_model", SRC / "opml_fl_coordinator" / "simulator" / "model.py")


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, kind, default in (("clients", int, 200), ("per-round", int, 10), ("rounds", int, 40),
                                ("epochs", int, 2), ("lr", float, 0.1), ("alpha", float, 0.5), ("seed", int, 0),
                                ("time-scale", float, 0.0), ("traits", str, ""),
                                ("cpus-per-client", float, 1.0)):
        parser.add_argument(f"--{name}", type=kind, default=default)
    args = parser.parse_args()

    import ray.cloudpickle
    from flwr.client import ClientApp, NumPyClient
    from flwr.common import Context, ndarrays_to_parameters
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import run_simulation

    for module in (data, model_module):  # Ray's workers cannot import them by name: ship them by value
        ray.cloudpickle.register_pickle_by_value(module)
    partition = data.partition_digits(args.clients, alpha=args.alpha, seed=args.seed)
    # The same resource heterogeneity as the fl-coordinator's simulator: each client takes
    # (examples / speed + delay) virtual seconds, slept here times --time-scale.
    traits = json.loads(Path(args.traits).read_text()) if args.traits else None
    model = model_module.SoftmaxModel(partition.test[0].shape[1], partition.classes)
    x_test, y_test = partition.test
    history: list[tuple[int, float, float]] = []
    started = [0.0]

    class Member(NumPyClient):
        def __init__(self, index: int) -> None:
            self.x, self.y = partition.clients[index]
            self.index = index
            self.rng = np.random.default_rng([args.seed, index])

        def fit(self, parameters, config):
            weights, done = model.fit([np.asarray(p) for p in parameters], self.x, self.y, epochs=args.epochs,
                                      batch_size=16, learning_rate=args.lr, rng=self.rng)
            if traits is not None:
                speed, delay = traits[self.index]
                time.sleep((done / speed + delay) * args.time_scale)
            return weights, done, {}

    def client_fn(context: Context):
        return Member(int(context.node_config["partition-id"])).to_client()

    def evaluate(server_round, parameters, config):
        loss, accuracy = model.evaluate([np.asarray(p) for p in parameters], x_test, y_test)
        if server_round == 0:
            started[0] = time.perf_counter()  # rounds start after Ray and the nodes are up
        history.append((server_round, time.perf_counter() - started[0], accuracy))
        return loss, {"accuracy": accuracy}

    def server_fn(context: Context):
        strategy = FedAvg(fraction_fit=args.per_round / args.clients, fraction_evaluate=0.0,
                          min_fit_clients=args.per_round, min_evaluate_clients=0,
                          min_available_clients=args.clients, evaluate_fn=evaluate,
                          initial_parameters=ndarrays_to_parameters(model.initial_weights()))
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=args.rounds))

    wall = time.perf_counter()
    run_simulation(server_app=ServerApp(server_fn=server_fn), client_app=ClientApp(client_fn=client_fn),
                   num_supernodes=args.clients, backend_config={"client_resources": {"num_cpus": args.cpus_per_client}})
    print(json.dumps({"history": history, "total_wall_s": time.perf_counter() - wall}))


if __name__ == "__main__":
    main()
