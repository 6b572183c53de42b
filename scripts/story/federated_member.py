"""One inspection line's member of the story's federation: its data stays in this process.

It reads its own line's files of the committed spans (``--span``, one per day) and its line's archive
of earlier inspections that were never committed (``--archive-rows``, made here: what a plant keeps
on site), holds a fifth of the rows out as its local validation, and takes part with the contract's
client SDK (``run_client``): the global model in, a few epochs of mini-batch Adam on its rows (numpy),
the new weights out. Lines keep different archives, so members differ in speed for real: the time a
round takes is the rows trained. The model is the pipeline's MLP (256 grey levels, one hidden ReLU
layer, 4 classes) as (kernel, bias) pairs, which the coordinator exports to ONNX. The member's token
is ``OPML_FL_CLIENT_TOKEN``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # inspection_data, beside story/
from inspection_data import CLASSES, inspection_patches, span_features  # noqa: E402

from opml_fl_coordinator_contract.client import NumPyClient, run_client  # noqa: E402

ARCHIVE_SEED = 1000
"""Seed of a line's archive: days no span was made of (spans are days 0, 1, ...)."""


def read_span(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One span file of the line: features (from the fourth column on) and labels."""
    table = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float32, ndmin=2)
    return table[:, 3:], table[:, 2].astype(np.int64)


def forward(weights: list[np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hidden activations, class probabilities)."""
    w1, b1, w2, b2 = weights
    hidden = np.maximum(x @ w1 + b1, 0)
    logits = hidden @ w2 + b2
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    return hidden, p / p.sum(axis=1, keepdims=True)


class LineMember(NumPyClient):
    def __init__(self, x: np.ndarray, y: np.ndarray, hidden: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        order = self.rng.permutation(len(x))
        cut = len(x) // 5
        self.x_val, self.y_val = x[order[:cut]], y[order[:cut]]
        self.x, self.y = x[order[cut:]], y[order[cut:]]
        self.hidden = hidden

    def num_examples(self) -> int:
        return len(self.x)

    def get_weights(self, config):
        """The starting model, asked of one member: He-initialised, the same for any member."""
        rng, features = np.random.default_rng(0), self.x.shape[1]
        return [rng.normal(0, np.sqrt(2 / features), (features, self.hidden)).astype(np.float32),
                np.zeros(self.hidden, np.float32),
                rng.normal(0, np.sqrt(1 / self.hidden), (self.hidden, CLASSES)).astype(np.float32),
                np.zeros(CLASSES, np.float32)]

    def evaluate(self, weights, config):
        _, p = forward(weights, self.x_val)
        loss = float(-np.log(p[np.arange(len(p)), self.y_val] + 1e-9).mean())
        return loss, len(self.y_val), {"accuracy": float((p.argmax(1) == self.y_val).mean())}

    def fit(self, weights, config):
        weights = [np.array(w, np.float32) for w in weights]
        epochs, batch = int(config.get("epochs", 1)), int(config.get("batch_size", 32))
        rate = float(config.get("learning_rate", 0.003))
        moments = [(np.zeros_like(w), np.zeros_like(w)) for w in weights]
        onehot, step, started = np.eye(CLASSES, dtype=np.float32)[self.y], 0, time.monotonic()
        for _ in range(epochs):
            order = self.rng.permutation(len(self.x))
            for start in range(0, len(order), batch):
                rows = order[start:start + batch]
                xb = self.x[rows]
                hidden, p = forward(weights, xb)
                d_logits = (p - onehot[rows]) / len(rows)
                d_hidden = (d_logits @ weights[2].T) * (hidden > 0)
                grads = [xb.T @ d_hidden, d_hidden.sum(0), hidden.T @ d_logits, d_logits.sum(0)]
                step += 1
                for w, g, (m, v) in zip(weights, grads, moments):
                    m[:] = 0.9 * m + 0.1 * g
                    v[:] = 0.999 * v + 0.001 * g * g
                    w -= rate * (m / (1 - 0.9 ** step)) / (np.sqrt(v / (1 - 0.999 ** step)) + 1e-8)
        _, p = forward(weights, self.x)
        print(f"round {int(config.get('server_round', 0))}: {epochs} epochs on {len(self.x)} rows in "
              f"{time.monotonic() - started:.2f} s, train accuracy {(p.argmax(1) == self.y).mean():.3f}", flush=True)
        return weights, len(self.x) * epochs, {"train_accuracy": float((p.argmax(1) == self.y).mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("target")
    parser.add_argument("federation")
    parser.add_argument("--line", type=int, required=True)
    parser.add_argument("--span", type=Path, action="append", default=[], help="the line's file of one span")
    parser.add_argument("--archive-rows", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()
    parts = [read_span(path) for path in args.span]
    if args.archive_rows:
        images, labels = inspection_patches(args.archive_rows, seed=ARCHIVE_SEED, line=args.line)
        parts.append((span_features(images).astype(np.float32), labels))
    x, y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    member = LineMember(x, y, args.hidden, seed=args.line)
    print(f"line {args.line}: {len(args.span)} span files and {args.archive_rows} archived rows, "
          f"{member.num_examples()} to train on, {len(member.y_val)} to validate", flush=True)
    done = run_client(args.target, args.federation, os.environ["OPML_FL_CLIENT_TOKEN"], member, wait_s=5.0)
    print(f"federation ended: {done.tasks} tasks, {done.accepted} accepted, {done.failures} failed, "
          f"rejected {done.rejected}", flush=True)


if __name__ == "__main__":
    main()
