"""ONNX models and model bundles built in code, for tests and benches (no files checked in).

``mlp_classifier`` is a ReLU MLP with a dynamic batch dimension whose width and depth set how much
work one batch is; ``write_model_dir`` lays out a bundle the worker loads (``model.yaml`` and
``model.onnx``); ``write_broken_onnx`` writes a file onnxruntime refuses to load;
``external_weights_model`` keeps its weights in a file it names, as large models do; ``poisoned_mlp``
fails at run time on a request that holds :data:`POISON` (a version whose requests fail).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import yaml
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def mlp_classifier(*, features: int = 16, width: int = 64, depth: int = 2, classes: int = 4,
                   seed: int = 0, input_name: str = "features", output_name: str = "scores") -> onnx.ModelProto:
    """``scores = softmax(relu(...relu(x W1 + b1)...) Wn + bn)`` on ``x: float32[batch, features]``.

    Weights are drawn from a seeded normal scaled by 1/sqrt(fan_in) so activations stay O(1) at any
    depth (int8 quantization then keeps the arg-max of most rows, as on a trained model).
    """
    rng = np.random.default_rng(seed)
    nodes, initializers = [], []
    previous, fan_in = input_name, features
    sizes = [width] * depth + [classes]
    for layer, size in enumerate(sizes):
        weight = (rng.standard_normal((fan_in, size)) / np.sqrt(fan_in)).astype(np.float32)
        bias = (0.1 * rng.standard_normal(size)).astype(np.float32)
        initializers += [numpy_helper.from_array(weight, f"w{layer}"), numpy_helper.from_array(bias, f"b{layer}")]
        nodes.append(helper.make_node("MatMul", [previous, f"w{layer}"], [f"mm{layer}"]))
        last = layer == len(sizes) - 1
        nodes.append(helper.make_node("Add", [f"mm{layer}", f"b{layer}"], ["logits" if last else f"z{layer}"]))
        if not last:
            nodes.append(helper.make_node("Relu", [f"z{layer}"], [f"h{layer}"]))
            previous = f"h{layer}"
        fan_in = size
    nodes.append(helper.make_node("Softmax", ["logits"], [output_name], axis=-1))
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info(output_name, TensorProto.FLOAT, ["batch", classes])],
        initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="opml-testing")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def mlp_config(name: str, *, features: int = 16, classes: int = 4, max_batch_size: int = 32,
               max_queue_delay_us: int | None = 2000, pool_kinds: tuple[str, ...] = ("cpu", "accel"),
               precisions: tuple[str, ...] = ("fp32", "int8"), input_name: str = "features",
               output_name: str = "scores", p99_ms: float = 50.0) -> dict[str, Any]:
    """The ModelConfig document matching :func:`mlp_classifier` (``max_queue_delay_us=None``: no batching)."""
    config: dict[str, Any] = {
        "name": name,
        "max_batch_size": max_batch_size,
        "inputs": [{"name": input_name, "data_type": "fp32", "dims": [features]}],
        "outputs": [{"name": output_name, "data_type": "fp32", "dims": [classes]}],
        "slo": {"p99_ms": p99_ms},
        "expected_rate_rps": 100.0,
        "pool_kinds": list(pool_kinds),
        "precisions": list(precisions),
    }
    if max_queue_delay_us is not None:
        config["dynamic_batching"] = {"max_queue_delay_us": max_queue_delay_us}
    return config


def write_model_dir(directory: Path, config: dict[str, Any], model: onnx.ModelProto | None = None,
                    *, versions: tuple[int, ...] = ()) -> Path:
    """A bundle directory: ``model.yaml`` plus ``model.onnx`` (flat), or one ``<version>/model.onnx``
    per entry of ``versions`` (Triton's repository layout). ``model`` defaults to a matching MLP."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    if model is None:
        model = mlp_classifier(features=config["inputs"][0]["dims"][0], classes=config["outputs"][0]["dims"][0])
    if versions:
        for version in versions:
            (directory / str(version)).mkdir(exist_ok=True)
            onnx.save(model, directory / str(version) / "model.onnx")
    else:
        onnx.save(model, directory / "model.onnx")
    return directory


POISON = 1000.0
"""A feature value :func:`poisoned_mlp` fails on (the profiler's normal inputs never hold one)."""


def poisoned_mlp(*, seed: int = 0) -> onnx.ModelProto:
    """:func:`mlp_classifier` behind a Reshape to ``[-1, 16 + any(x > 100)]``: a request holding
    :data:`POISON` fails in onnxruntime at run time; every other input (the profiler's too) is answered
    as the plain MLP answers it."""
    model = mlp_classifier(seed=seed)
    graph = model.graph
    for node in graph.node:
        node.input[:] = ["checked" if name == "features" else name for name in node.input]
    guard = [
        helper.make_node("Greater", ["features", "hundred"], ["big"]),
        helper.make_node("Cast", ["big"], ["big_int"], to=TensorProto.INT64),
        helper.make_node("ReduceMax", ["big_int"], ["any_big"], keepdims=0),
        helper.make_node("Mul", ["any_big", "zero_one"], ["extra"]),
        helper.make_node("Add", ["base_shape", "extra"], ["shape"]),
        helper.make_node("Reshape", ["features", "shape"], ["checked"]),
    ]
    graph.initializer.extend([helper.make_tensor("hundred", TensorProto.FLOAT, [], [100.0]),
                              helper.make_tensor("zero_one", TensorProto.INT64, [2], [0, 1]),
                              helper.make_tensor("base_shape", TensorProto.INT64, [2], [-1, 16])])
    nodes = guard + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    return model


def write_broken_onnx(path: Path) -> Path:
    """A well-formed protobuf whose graph onnxruntime refuses: a node of an operator that does not exist."""
    graph = helper.make_graph(
        [helper.make_node("NoSuchOperator", ["features"], ["scores"])], "broken",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def external_weights_model(location: str, *, features: int = 16, classes: int = 4) -> onnx.ModelProto:
    """``scores = features @ W1``, the weights ``W1`` (float32[features, classes]) kept as external data
    in the file ``location`` names (relative to the model's file, as onnx saves them), from its first
    byte. Fed the identity matrix it answers ``W1`` itself: the file's first ``features * classes * 4``
    bytes, so a test sees exactly which file a session read. Matches :func:`mlp_config` (no checker:
    it would refuse the locations tests give on purpose)."""
    weights = TensorProto(name="W1", data_type=TensorProto.FLOAT, dims=[features, classes],
                          data_location=TensorProto.EXTERNAL)
    weights.external_data.add(key="location", value=location)
    weights.external_data.add(key="length", value=str(features * classes * 4))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["features", "W1"], ["scores"])], "external_weights",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", classes])], [weights])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="opml-testing")
    model.ir_version = 8
    return model
