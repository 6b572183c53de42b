"""A pipeline's training program, as a user writes one: reads the spans the pipeline hands it
(``OPML_PIPELINE_SPANS``: one folder per span, CSV files with a header), fits a logistic regression
with numpy (from the blessed model's weights when ``OPML_PIPELINE_WARM_START`` is set), and writes
``model.onnx`` + ``model.yaml`` (the inference-router's model config) to ``OPML_PIPELINE_MODEL_DIR``.

For the tests: with ``HOLD_FILE`` set it waits for that file before it writes the model (a test
stops the service meanwhile), and it appends one line to ``COMPLETIONS_FILE`` when it finishes.
"""

from __future__ import annotations

import csv
import os
import time
from pathlib import Path

import numpy as np
import onnx
import yaml
from onnx import TensorProto, helper, numpy_helper

FEATURES = ("x1", "x2")


def read_rows(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    features, labels = [], []
    for path in sorted(folder.rglob("*.csv")):
        with path.open() as handle:
            for row in csv.DictReader(handle):
                features.append([float(row[name]) for name in FEATURES])
                labels.append(int(row["label"]))
    return np.asarray(features, dtype=np.float64), np.asarray(labels)


def main() -> None:
    spans = Path(os.environ["OPML_PIPELINE_SPANS"])
    parts = [read_rows(folder) for folder in sorted(spans.iterdir())]
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    weights, bias = np.zeros((2, 2)), np.zeros(2)
    warm = os.environ.get("OPML_PIPELINE_WARM_START")
    if warm:
        initializers = {i.name: numpy_helper.to_array(i) for i in onnx.load(Path(warm) / "model.onnx").graph.initializer}
        weights, bias = initializers["W"].astype(np.float64), initializers["B"].astype(np.float64)
    onehot = np.eye(2)[y]
    for _ in range(200):
        logits = x @ weights + bias
        probabilities = np.exp(logits - logits.max(axis=1, keepdims=True))
        probabilities /= probabilities.sum(axis=1, keepdims=True)
        gradient = probabilities - onehot
        weights -= 0.5 * x.T @ gradient / len(x)
        bias -= 0.5 * gradient.mean(axis=0)
    if hold := os.environ.get("HOLD_FILE"):
        while not Path(hold).exists():
            time.sleep(0.05)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["features", "W"], ["logits"]), helper.make_node("Add", ["logits", "B"], ["z"]),
         helper.make_node("Softmax", ["z"], ["scores"], axis=1)],
        "pipeline-model",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [None, 2])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, 2])],
        [numpy_helper.from_array(weights.astype(np.float32), "W"), numpy_helper.from_array(bias.astype(np.float32), "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    out = Path(os.environ["OPML_PIPELINE_MODEL_DIR"])
    onnx.save(model, out / "model.onnx")
    (out / "model.yaml").write_text(yaml.safe_dump({
        "name": os.environ.get("MODEL_NAME", "quality"), "max_batch_size": 64,
        "inputs": [{"name": "features", "data_type": "fp32", "dims": [2]}],
        "outputs": [{"name": "scores", "data_type": "fp32", "dims": [2]}],
        "slo": {"p99_ms": 50.0}, "expected_rate_rps": 10.0, "pool_kinds": ["cpu"], "precisions": ["fp32"]},
        sort_keys=False))
    if completions := os.environ.get("COMPLETIONS_FILE"):
        with open(completions, "a") as handle:
            handle.write(f"{os.environ.get('OPML_JOB_ATTEMPT', '?')}\n")


if __name__ == "__main__":
    main()
