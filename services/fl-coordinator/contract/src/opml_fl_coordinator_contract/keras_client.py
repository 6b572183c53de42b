"""A federation member that trains a Keras model locally (TensorFlow is imported by the caller's
model; this module only drives it). It applies FedProx's proximal term ``mu/2 ||w - w_global||^2``
when the round's config carries ``proximal_mu``, and stops early with the work done so far when
the config carries ``time_budget_s`` (partial work of a straggler).

Part of the members' SDK, so of the contract; keras and TensorFlow are imported inside
:meth:`KerasClient.fit` only, so the contract never depends on them."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from opml_fl_coordinator_contract.client import NumPyClient
from opml_fl_coordinator_contract.weights import Weights


class KerasClient(NumPyClient):
    """``model`` must be compiled (its loss and optimizer are used); ``x, y`` train, ``x_val,
    y_val`` (default: the training data) evaluate."""

    def __init__(self, model: Any, x: np.ndarray, y: np.ndarray, x_val: np.ndarray | None = None,
                 y_val: np.ndarray | None = None, *, seed: int = 0) -> None:
        self.model, self.x, self.y = model, x, y
        self.x_val = x if x_val is None else x_val
        self.y_val = y if y_val is None else y_val
        self._rng = np.random.default_rng(seed)

    def num_examples(self) -> int:
        return len(self.y)

    def get_weights(self, config: dict[str, float]) -> Weights:
        return [np.asarray(w) for w in self.model.get_weights()]

    def evaluate(self, weights: Weights, config: dict[str, float]) -> tuple[float, int, dict[str, float]]:
        """The loss, and the accuracy when the model was compiled with an accuracy metric."""
        self.model.set_weights(weights)
        results = self.model.evaluate(self.x_val, self.y_val, verbose=0, return_dict=True)
        accuracy = next((float(v) for k, v in results.items() if "acc" in k), None)
        return float(results["loss"]), len(self.y_val), {} if accuracy is None else {"accuracy": accuracy}

    def fit(self, weights: Weights, config: dict[str, float]) -> tuple[Weights, int, dict[str, float]]:
        import keras
        import tensorflow as tf

        self.model.set_weights(weights)
        epochs = int(config.get("epochs", 1))
        batch_size = int(config.get("batch_size", 32))
        mu = float(config.get("proximal_mu", 0.0))
        budget = config.get("time_budget_s")
        stop_at = time.monotonic() + float(budget) if budget is not None else None
        if "learning_rate" in config and hasattr(self.model.optimizer, "learning_rate"):
            self.model.optimizer.learning_rate.assign(float(config["learning_rate"]))
        anchors = [tf.constant(w) for w in weights]
        variables = self.model.trainable_variables
        loss_fn = keras.losses.get(self.model.loss) if isinstance(self.model.loss, str) else self.model.loss
        done, last_loss = 0, float("nan")
        for _ in range(epochs):
            order = self._rng.permutation(len(self.y))
            for start in range(0, len(order), batch_size):
                if stop_at is not None and time.monotonic() >= stop_at:
                    return self._result(done, last_loss)
                batch = order[start:start + batch_size]
                with tf.GradientTape() as tape:
                    loss = loss_fn(self.y[batch], self.model(self.x[batch], training=True))
                    loss = tf.reduce_mean(loss)
                    if mu > 0:  # trainable variables come first in get_weights' order for these models
                        loss += mu / 2 * tf.add_n([tf.reduce_sum(tf.square(v - a))
                                                   for v, a in zip(variables, anchors, strict=False)])
                grads = tape.gradient(loss, variables)
                self.model.optimizer.apply_gradients(zip(grads, variables, strict=True))
                done += len(batch)
                last_loss = float(loss)
        return self._result(done, last_loss)

    def _result(self, done: int, loss: float) -> tuple[Weights, int, dict[str, float]]:
        """No batch done (no time left): no training loss to report."""
        return [np.asarray(w) for w in self.model.get_weights()], max(done, 1), {"train_loss": loss} if done else {}
