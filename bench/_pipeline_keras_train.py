"""A pipeline's training program with Keras, as a user writes one (the warm-start bench's job).

Reads the spans the pipeline hands it (``OPML_PIPELINE_SPANS``: one folder per span, CSV with a
header; the last column ``label``), holds out the newest span's last fifth for validation, and fits
an MLP epoch by epoch until its validation accuracy reaches ``TARGET_ACCURACY`` (or ``MAX_EPOCHS``
pass). With ``OPML_PIPELINE_WARM_START`` it starts from that model's ``weights.npz`` (the blessed
model's files: its variables, set into the same architecture, a fresh optimizer; loading a whole
``.keras`` model took 5-10 s more here than building one) and first checks whether it is there
already (0 epochs). Writes ``weights.npz``,
``model.onnx`` (the Dense layers as MatMul/Add/Relu/Softmax, built with ``onnx.helper``) and
``model.yaml`` to ``OPML_PIPELINE_MODEL_DIR``, and one JSON line on stdout: the seconds from the
process's start to the target (TensorFlow's import included) and to the model ready to train (imports,
spans read, model built or loaded), the epochs, the accuracy reached.
"""

from __future__ import annotations

import time

STARTED = time.monotonic()

import json  # noqa: E402 - the clock starts before the imports, which the job pays too
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras  # noqa: E402
import onnx  # noqa: E402
import yaml  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402


def read_span(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    tables = [np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float32) for path in sorted(folder.rglob("*.csv"))]
    table = np.concatenate(tables)
    return table[:, :-1], table[:, -1].astype(np.int64)


def build(features: int, hidden: int, seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(hidden, activation="relu"),
                              keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer=keras.optimizers.Adam(float(os.environ.get("LEARNING_RATE", "0.001"))),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def to_onnx(model: keras.Model, features: int) -> onnx.ModelProto:
    nodes, initializers, current = [], [], "features"
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    for index, layer in enumerate(dense):
        weights, bias = layer.get_weights()
        initializers += [numpy_helper.from_array(weights.astype(np.float32), f"W{index}"),
                         numpy_helper.from_array(bias.astype(np.float32), f"B{index}")]
        nodes += [helper.make_node("MatMul", [current, f"W{index}"], [f"m{index}"]),
                  helper.make_node("Add", [f"m{index}", f"B{index}"], [f"a{index}"])]
        last = index == len(dense) - 1
        nodes.append(helper.make_node("Softmax", [f"a{index}"], ["scores"], axis=1) if last
                     else helper.make_node("Relu", [f"a{index}"], [f"h{index}"]))
        current = f"h{index}"
    graph = helper.make_graph(nodes, "pipeline-keras", [helper.make_tensor_value_info("features", TensorProto.FLOAT,
                                                                                      [None, features])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, 2])], initializers)
    exported = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    exported.ir_version = 8
    return exported


def main() -> None:
    spans = sorted(Path(os.environ["OPML_PIPELINE_SPANS"]).iterdir())
    parts = [read_span(folder) for folder in spans]
    x_new, y_new = parts[-1]
    cut = int(len(x_new) * 0.8)
    x = np.concatenate([p[0] for p in parts[:-1]] + [x_new[:cut]])
    y = np.concatenate([p[1] for p in parts[:-1]] + [y_new[:cut]])
    x_val, y_val = x_new[cut:], y_new[cut:]
    target, max_epochs = float(os.environ["TARGET_ACCURACY"]), int(os.environ.get("MAX_EPOCHS", "200"))
    warm = os.environ.get("OPML_PIPELINE_WARM_START")
    seed = int(os.environ.get("SEED", "0"))
    model = build(x.shape[1], int(os.environ.get("HIDDEN", "64")), seed)
    if warm:  # the blessed model's variables (as TFX's warm start loads a checkpoint's), a fresh optimizer
        with np.load(Path(warm) / "weights.npz") as saved:
            model.set_weights([saved[f"w{i}"] for i in range(len(saved.files))])
    ready = time.monotonic() - STARTED  # imports, spans read, model built or loaded
    epochs, accuracy = 0, float(model.evaluate(x_val, y_val, verbose=0, batch_size=1024)[1])
    while accuracy < target and epochs < max_epochs:
        model.fit(x, y, epochs=1, batch_size=int(os.environ.get("BATCH_SIZE", "128")), verbose=0, shuffle=True)
        epochs += 1
        accuracy = float(model.evaluate(x_val, y_val, verbose=0, batch_size=1024)[1])
    reached = time.monotonic() - STARTED
    out = Path(os.environ["OPML_PIPELINE_MODEL_DIR"])
    np.savez(out / "weights.npz", **{f"w{i}": w for i, w in enumerate(model.get_weights())})
    onnx.save(to_onnx(model, x.shape[1]), out / "model.onnx")
    (out / "model.yaml").write_text(yaml.safe_dump({
        "name": os.environ.get("MODEL_NAME", "quality"), "max_batch_size": 64,
        "inputs": [{"name": "features", "data_type": "fp32", "dims": [int(x.shape[1])]}],
        "outputs": [{"name": "scores", "data_type": "fp32", "dims": [2]}],
        "slo": {"p99_ms": 50.0}, "expected_rate_rps": 10.0, "pool_kinds": ["cpu"], "precisions": ["fp32"]},
        sort_keys=False))
    print(json.dumps({"seconds_to_target": reached, "setup_seconds": ready, "epochs": epochs, "accuracy": accuracy,
                      "reached": accuracy >= target}), flush=True)


if __name__ == "__main__":
    main()
