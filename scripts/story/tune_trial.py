"""One trial of the story's tuning experiment: a plain Keras MLP on the committed inspection spans.

Nothing in it knows about tracing: the automl-controller's Trace collector reads the epoch logs
Keras gives its callbacks (``val_accuracy`` is the objective), through the tracer the orchestrator
puts in the traced job. The model is exported to ONNX and uploaded with the trial's own grant
(``opml_automl_controller.sdk.save_model``), so the experiment's best is committed as a bundle.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf2onnx  # noqa: E402

from opml_automl_controller.sdk import model_dir, save_model  # noqa: E402

CLASSES = 4


def load_spans(folder: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every span's CSVs under ``folder`` (``<day>/line-<n>.csv``: ``line``, ``day``, ``label``,
    ``p000``..): features, labels, days."""
    tables = [np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float32, ndmin=2)
              for path in sorted(folder.rglob("*.csv"))]
    table = np.concatenate(tables)
    return table[:, 3:], table[:, 2].astype(np.int64), table[:, 1].astype(np.int64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spans", type=Path, required=True)
    parser.add_argument("--learning-rate", type=float, required=True)
    parser.add_argument("--units", type=int, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    args = parser.parse_args()

    features, labels, days = load_spans(args.spans)
    held_out = days == days.max()  # the newest day validates: the trial is judged on data it never saw
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([
        tf.keras.Input((features.shape[1],), name="features"),
        tf.keras.layers.Dense(args.units, activation="relu"),
        tf.keras.layers.Dense(args.units // 2, activation="relu"),
        tf.keras.layers.Dense(CLASSES),
    ])
    model.compile(optimizer=tf.keras.optimizers.Adam(args.learning_rate),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(features[~held_out], labels[~held_out], validation_data=(features[held_out], labels[held_out]),
              batch_size=32, epochs=args.epochs, verbose=2)

    out = model_dir()
    signature = (tf.TensorSpec((None, features.shape[1]), tf.float32, name="features"),)
    serve = tf.function(lambda x: {"defect_scores": tf.nn.softmax(model(x))})
    onnx_model, _ = tf2onnx.convert.from_function(serve, input_signature=signature, opset=17)
    (out / "model.onnx").write_bytes(onnx_model.SerializeToString())
    _, accuracy = model.evaluate(features[held_out], labels[held_out], verbose=0)
    (out / "metrics.json").write_text(json.dumps({"val_accuracy": accuracy, "units": args.units,
                                                  "learning_rate": args.learning_rate}))
    save_model(out)


if __name__ == "__main__":
    main()
