"""The main job's training program: a defect classifier for the vision-inspection lines.

A plain Keras program (nothing in it knows about tracing or the platform): it trains a small CNN
on synthetic 32x32 inspection patches (``inspection_data``) whose defect class is where a bright
scratch lies (none, left, right, centre), evaluates it, and writes a servable model directory to
``--out``: ``model.onnx`` (exported with tf2onnx), ``model.yaml`` (the inference-router's model
config) and ``metrics.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
import tf2onnx  # noqa: E402
import yaml  # noqa: E402
from inspection_data import CLASS_NAMES, CLASSES, SIZE, inspection_patches  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args()

    train_x, train_y = inspection_patches(2048, seed=1)
    test_x, test_y = inspection_patches(512, seed=2)
    model = tf.keras.Sequential([
        tf.keras.Input((SIZE, SIZE, 1), name="image"),
        tf.keras.layers.Conv2D(16, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.GlobalAveragePooling2D(),
        tf.keras.layers.Dense(CLASSES),
    ])
    model.compile(optimizer=tf.keras.optimizers.Adam(3e-3),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(train_x, train_y, batch_size=64, epochs=args.epochs, verbose=2)
    loss, accuracy = model.evaluate(test_x, test_y, batch_size=128, verbose=0)
    print(f"test accuracy {accuracy:.3f} loss {loss:.3f}")

    args.out.mkdir(parents=True, exist_ok=True)
    signature = (tf.TensorSpec((None, SIZE, SIZE, 1), tf.float32, name="image"),)
    serve = tf.function(lambda image: {"defect_scores": tf.nn.softmax(model(image))})
    onnx_model, _ = tf2onnx.convert.from_function(serve, input_signature=signature, opset=17)
    (args.out / "model.onnx").write_bytes(onnx_model.SerializeToString())
    (args.out / "model.yaml").write_text(yaml.safe_dump({
        "name": "defect-classifier",
        "max_batch_size": 32,
        "inputs": [{"name": "image", "data_type": "fp32", "dims": [SIZE, SIZE, 1]}],
        "outputs": [{"name": "defect_scores", "data_type": "fp32", "dims": [CLASSES]}],
        "dynamic_batching": {"max_queue_delay_us": 2000},
        "slo": {"p99_ms": 100},
        "expected_rate_rps": 20,
        "pool_kinds": ["cpu"],
        "precisions": ["fp32"],
    }, sort_keys=False))
    (args.out / "metrics.json").write_text(json.dumps({"accuracy": accuracy, "loss": loss,
                                                       "classes": list(CLASS_NAMES)}))


if __name__ == "__main__":
    main()
