"""A federation member for the tests: softmax regression (numpy) on one shard of sklearn's digits,
or a Keras model with --keras. Behaviours: normal, slow (sleeps before answering), crash (exits
mid-task in the given round), nan (sends NaN weights). ``--pad`` adds an array of that many
float32 values that the member sends back unchanged, to make the model larger than gRPC's
message limit. Run as ``python member.py TARGET FEDERATION INDEX [options]`` with the client
token in OPML_FL_CLIENT_TOKEN."""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from opml_fl_coordinator.simulator import SoftmaxModel, partition_digits
from opml_fl_coordinator_contract.client import NumPyClient, run_client


class DigitsMember(NumPyClient):
    def __init__(self, index: int, shards: int, *, behaviour: str = "normal", slow_s: float = 0.0,
                 crash_round: int = 0, pad: int = 0, seed: int = 0) -> None:
        partition = partition_digits(shards, alpha=1.0, seed=seed)
        self.x, self.y = partition.clients[index]
        self.model = SoftmaxModel(self.x.shape[1], partition.classes)
        self.behaviour, self.slow_s, self.crash_round, self.pad = behaviour, slow_s, crash_round, pad
        self.rng = np.random.default_rng(index)

    def num_examples(self):
        return len(self.y)

    def get_weights(self, config):
        weights = self.model.initial_weights()
        return weights + ([np.zeros(self.pad, np.float32)] if self.pad else [])

    def evaluate(self, weights, config):
        loss, accuracy = self.model.evaluate(weights[:2], self.x, self.y)
        return loss, len(self.y), {"accuracy": accuracy}

    def fit(self, weights, config):
        if self.behaviour == "crash" and int(config.get("server_round", 0)) >= self.crash_round:
            print("member: crashing mid-round", flush=True)
            os._exit(3)
        trained, done = self.model.fit(weights[:2], self.x, self.y, epochs=int(config.get("epochs", 1)),
                                       batch_size=int(config.get("batch_size", 16)),
                                       learning_rate=float(config.get("learning_rate", 0.1)), rng=self.rng)
        if self.behaviour == "slow":
            time.sleep(self.slow_s)
        if self.behaviour == "nan":
            trained = [np.full_like(w, np.nan) for w in trained]
        return trained + list(weights[2:]), done, {"train_loss": float("nan")} if self.behaviour == "nan-metric" else {}


class KerasDigitsMember(DigitsMember):
    """The same shard, trained by Keras through :class:`KerasClient`."""

    def __init__(self, index: int, shards: int, **kwargs) -> None:
        super().__init__(index, shards, **kwargs)
        import keras

        from opml_fl_coordinator_contract.keras_client import KerasClient

        keras.utils.set_random_seed(index)
        model = keras.Sequential([keras.Input((self.x.shape[1],)), keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        self.keras = KerasClient(model, self.x, self.y)
        # warm up (TensorFlow traces its functions on first use) before joining, so the first
        # round's time is the member's speed, not TensorFlow's start-up
        initial = self.keras.get_weights({})
        self.keras.evaluate(initial, {})
        self.keras.fit(initial, {"epochs": 1, "batch_size": 16})
        model.set_weights(initial)

    def get_weights(self, config):
        return self.keras.get_weights(config)

    def evaluate(self, weights, config):
        return self.keras.evaluate(weights, config)

    def fit(self, weights, config):
        if self.behaviour == "crash" and int(config.get("server_round", 0)) >= self.crash_round:
            print("member: crashing mid-round", flush=True)
            os._exit(3)
        trained, done, metrics = self.keras.fit(weights, config)
        if self.behaviour == "slow":
            time.sleep(self.slow_s)
        if self.behaviour == "nan":
            trained = [np.full_like(w, np.nan) for w in trained]
        return trained, done, metrics


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("federation")
    parser.add_argument("index", type=int)
    parser.add_argument("--shards", type=int, default=6)
    parser.add_argument("--behaviour", default="normal", choices=["normal", "slow", "crash", "nan"])
    parser.add_argument("--slow-s", type=float, default=0.0)
    parser.add_argument("--crash-round", type=int, default=0)
    parser.add_argument("--pad", type=int, default=0)
    parser.add_argument("--keras", action="store_true")
    args = parser.parse_args()
    kind = KerasDigitsMember if args.keras else DigitsMember
    member = kind(args.index, args.shards, behaviour=args.behaviour, slow_s=args.slow_s,
                  crash_round=args.crash_round, pad=args.pad)
    run = run_client(args.target, args.federation, os.environ["OPML_FL_CLIENT_TOKEN"], member,
                     token=os.environ.get("OPML_TOKEN"), wait_s=5.0)
    print(f"member {args.index}: done, {run.tasks} tasks, {run.accepted} accepted, rejected {run.rejected}",
          flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
