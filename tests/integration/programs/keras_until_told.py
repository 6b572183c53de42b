"""A plain Keras program that trains until told to stop: the dashboards test's second traced job.

It fits a tiny model epoch after epoch until the file named by ``--stop`` exists, so the test can see
the job's first step metrics scraped before later ones arrive (a rate needs an increase between two
scrapes, and a job that ends within one flush interval ships all it has in one batch).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


class StopWhenTold(tf.keras.callbacks.Callback):
    """Ends the fit at the first epoch end after the stop file appears."""

    def __init__(self, stop: Path) -> None:
        super().__init__()
        self.stop = stop

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.stop.exists():
            self.model.stop_training = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stop", type=Path, required=True)
    parser.add_argument("--max-epochs", type=int, default=20_000, help="bound on the run if never told")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    features = rng.random((256, 8), dtype=np.float32)
    labels = (features.sum(axis=1) > 4).astype(np.int32)
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(2)])
    model.compile("adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(features, labels, batch_size=32, epochs=args.max_epochs, verbose=0,
              callbacks=[StopWhenTold(args.stop)])


if __name__ == "__main__":
    main()
