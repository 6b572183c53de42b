"""The inspection pipeline's training program, as a user writes one: an MLP on the spans' 16x16 patches.

It reads the spans the pipeline hands it (``OPML_PIPELINE_SPANS``: one folder per span, a CSV per
line), trains a one-hidden-layer MLP with numpy (from the blessed model's weights when
``OPML_PIPELINE_WARM_START`` is set: the continuous pipeline's warm start), and writes ``model.onnx``
(input ``features`` [batch, 256], output ``defect_scores``) and ``model.yaml`` (the inference-router's
model config) to ``OPML_PIPELINE_MODEL_DIR``. ``EPOCHS`` and ``HIDDEN`` come from the step's env.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import yaml
from onnx import TensorProto, helper, numpy_helper

CLASSES = 4
MODEL = os.environ.get("MODEL_NAME", "inspection")


def read_spans(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    tables = [np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float32, ndmin=2)
              for path in sorted(folder.rglob("*.csv"))]
    table = np.concatenate(tables)
    return table[:, 3:], table[:, 2].astype(np.int64)


def start_weights(features: int, hidden: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    warm = os.environ.get("OPML_PIPELINE_WARM_START")
    if warm:
        weights = {i.name: numpy_helper.to_array(i).astype(np.float32)
                   for i in onnx.load(Path(warm) / "model.onnx").graph.initializer}
        print(f"warm start from {warm}: hidden {weights['W1'].shape[1]}")
        return weights
    print("cold start")
    return {"W1": rng.normal(0, np.sqrt(2 / features), (features, hidden)).astype(np.float32),
            "B1": np.zeros(hidden, np.float32),
            "W2": rng.normal(0, np.sqrt(1 / hidden), (hidden, CLASSES)).astype(np.float32),
            "B2": np.zeros(CLASSES, np.float32)}


def train(x: np.ndarray, y: np.ndarray, weights: dict[str, np.ndarray], epochs: int,
          rng: np.random.Generator, *, peak_lr: float = 3e-3) -> dict[str, np.ndarray]:
    """Mini-batch Adam on the cross-entropy, its learning rate falling from ``peak_lr`` to 0 along a
    cosine: a few seconds on a CPU for the story's spans. (At a constant rate the last epoch's weights
    were as likely a bad step as a good one: a warm retraining ended 5 points below the model it
    started from, on the very span it trained on.)"""
    moments = {name: (np.zeros_like(w), np.zeros_like(w)) for name, w in weights.items()}
    onehot, step = np.eye(CLASSES, dtype=np.float32)[y], 0
    steps = epochs * -(-len(x) // 64)
    for epoch in range(epochs):
        order = rng.permutation(len(x))
        for start in range(0, len(x), 64):
            batch = order[start:start + 64]
            xb, yb = x[batch], onehot[batch]
            hidden = np.maximum(xb @ weights["W1"] + weights["B1"], 0)
            logits = hidden @ weights["W2"] + weights["B2"]
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            d_logits = (p - yb) / len(batch)
            d_hidden = (d_logits @ weights["W2"].T) * (hidden > 0)
            grads = {"W2": hidden.T @ d_logits, "B2": d_logits.sum(0), "W1": xb.T @ d_hidden, "B1": d_hidden.sum(0)}
            step += 1
            for name, grad in grads.items():
                m, v = moments[name]
                m[:] = 0.9 * m + 0.1 * grad
                v[:] = 0.999 * v + 0.001 * grad * grad
                rate = peak_lr * 0.5 * (1 + np.cos(np.pi * (step - 1) / steps))
                weights[name] -= rate * (m / (1 - 0.9 ** step)) / (np.sqrt(v / (1 - 0.999 ** step)) + 1e-8)
        hidden = np.maximum(x @ weights["W1"] + weights["B1"], 0)
        accuracy = float(((hidden @ weights["W2"] + weights["B2"]).argmax(1) == y).mean())
        print(f"epoch {epoch + 1}/{epochs} train accuracy {accuracy:.3f}", flush=True)
    return weights


def export(weights: dict[str, np.ndarray], features: int, out: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["features", "W1"], ["h0"]), helper.make_node("Add", ["h0", "B1"], ["h1"]),
         helper.make_node("Relu", ["h1"], ["h"]), helper.make_node("MatMul", ["h", "W2"], ["z0"]),
         helper.make_node("Add", ["z0", "B2"], ["z"]), helper.make_node("Softmax", ["z"], ["defect_scores"], axis=1)],
        "inspection-mlp",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [None, features])],
        [helper.make_tensor_value_info("defect_scores", TensorProto.FLOAT, [None, CLASSES])],
        [numpy_helper.from_array(w, name) for name, w in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, out / "model.onnx")
    (out / "model.yaml").write_text(yaml.safe_dump({
        "name": MODEL, "max_batch_size": 64,
        "inputs": [{"name": "features", "data_type": "fp32", "dims": [features]}],
        "outputs": [{"name": "defect_scores", "data_type": "fp32", "dims": [CLASSES]}],
        "slo": {"p99_ms": 50.0}, "expected_rate_rps": 50.0,
        # served on both at once (the inference-router's instance groups, after Triton's instance_group):
        # the cheap int8 accelerator and the cpu pool in fp32 beside it, requests split by load
        "pool_kinds": ["accel", "cpu"], "precisions": ["fp32", "int8"],
        "instance_groups": [{"pool_kind": "accel", "precision": "int8", "count": 1},
                            {"pool_kind": "cpu", "precision": "fp32", "count": 1}]},
        sort_keys=False))


def main() -> None:
    x, y = read_spans(Path(os.environ["OPML_PIPELINE_SPANS"]))
    rng = np.random.default_rng(0)
    weights = start_weights(x.shape[1], int(os.environ.get("HIDDEN", "64")), rng)
    weights = train(x, y, weights, int(os.environ.get("EPOCHS", "20")), rng)
    export(weights, x.shape[1], Path(os.environ["OPML_PIPELINE_MODEL_DIR"]))


if __name__ == "__main__":
    main()
