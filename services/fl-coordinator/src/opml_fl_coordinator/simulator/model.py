"""A cheap model for simulations: multinomial logistic (softmax) regression in numpy, trained by
minibatch SGD, with FedProx's proximal term when the round's config asks for it."""

from __future__ import annotations

import numpy as np

from opml_fl_coordinator_contract.weights import Weights


class SoftmaxModel:
    def __init__(self, features: int, classes: int) -> None:
        self.features, self.classes = features, classes

    def initial_weights(self) -> Weights:
        return [np.zeros((self.features, self.classes), np.float32), np.zeros(self.classes, np.float32)]

    @staticmethod
    def _probabilities(weights: Weights, x: np.ndarray) -> np.ndarray:
        logits = x @ weights[0] + weights[1]
        logits -= logits.max(axis=1, keepdims=True)
        exp = np.exp(logits)
        return exp / exp.sum(axis=1, keepdims=True)

    def evaluate(self, weights: Weights, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """(cross-entropy loss, accuracy) of ``weights`` on ``x, y``."""
        p = self._probabilities(weights, x)
        loss = float(-np.mean(np.log(p[np.arange(len(y)), y] + 1e-12)))
        return loss, float(np.mean(p.argmax(axis=1) == y))

    def fit(self, weights: Weights, x: np.ndarray, y: np.ndarray, *, epochs: int, batch_size: int,
            learning_rate: float, rng: np.random.Generator, proximal_mu: float = 0.0,
            max_examples: int | None = None) -> tuple[Weights, int]:
        """Train from ``weights``; returns the new weights and the examples processed (at most
        ``max_examples``: partial work of a straggler)."""
        w, b = weights[0].astype(np.float64), weights[1].astype(np.float64)
        w0, b0 = w.copy(), b.copy()
        onehot = np.eye(self.classes)[y]
        done = 0
        budget = max_examples if max_examples is not None else epochs * len(y)
        for _ in range(epochs):
            order = rng.permutation(len(y))
            for start in range(0, len(y), batch_size):
                if done >= budget:
                    return [w.astype(np.float32), b.astype(np.float32)], done
                batch = order[start:start + batch_size][: budget - done]
                p = self._probabilities([w, b], x[batch])
                grad = p - onehot[batch]
                w -= learning_rate * (x[batch].T @ grad / len(batch) + proximal_mu * (w - w0))
                b -= learning_rate * (grad.mean(axis=0) + proximal_mu * (b - b0))
                done += len(batch)
        return [w.astype(np.float32), b.astype(np.float32)], done
