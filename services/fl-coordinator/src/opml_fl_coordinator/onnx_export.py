"""The global model as ONNX, for the inference-router: a dense classifier (the Keras members'
``Dense`` stack, or the simulator's softmax regression) written straight from its weights.

Weights come as (kernel, bias) pairs in layer order; hidden layers use ``hidden_activation`` (one of
:data:`ACTIVATIONS`: what a federation's ``model.hidden_activation`` may name), the last a softmax. The graph takes ``input`` [batch, features] float32 and gives ``probabilities``
[batch, classes], with a dynamic batch dimension, so the router can batch it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from opml_common.errors import InvalidArgument
from opml_fl_coordinator_contract.weights import Weights

ACTIVATIONS = {"relu": "Relu", "tanh": "Tanh", "sigmoid": "Sigmoid", "linear": None}
"""Keras activation name -> ONNX operator (None: the layer's output as it is)."""


def dense_classifier_onnx(weights: Weights, *, hidden_activation: str = "relu", opset: int = 17) -> bytes:
    """The serialized ONNX model of a dense classifier with these weights.

    Raises:
        ValueError: the weights are not (kernel [in, out], bias [out]) pairs that chain.
        InvalidArgument: ``model.hidden_activation``: the hidden layers' activation has no export here
            (the message names the first hidden layer and the activation).
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if not weights or len(weights) % 2:
        raise ValueError(f"weights must be (kernel, bias) pairs, but got {len(weights)} arrays")
    layers: Sequence[tuple[np.ndarray, np.ndarray]] = list(zip(weights[0::2], weights[1::2], strict=True))
    for index, (kernel, bias) in enumerate(layers):
        if kernel.ndim != 2 or bias.shape != (kernel.shape[1],):
            raise ValueError(f"layer {index}: kernel {kernel.shape} and bias {bias.shape} do not make a dense layer")
        if index and kernel.shape[0] != layers[index - 1][0].shape[1]:
            raise ValueError(f"layer {index} takes {kernel.shape[0]} inputs, the layer before gives "
                             f"{layers[index - 1][0].shape[1]}")
    if len(layers) > 1 and hidden_activation not in ACTIVATIONS:
        raise InvalidArgument("model.hidden_activation", f"layer 0 (dense, hidden) has activation "
                              f"{hidden_activation!r}, which has no ONNX export; exported: {sorted(ACTIVATIONS)}")
    nodes, initializers, current = [], [], "input"
    for index, (kernel, bias) in enumerate(layers):
        initializers += [numpy_helper.from_array(np.asarray(kernel, np.float32), f"kernel_{index}"),
                         numpy_helper.from_array(np.asarray(bias, np.float32), f"bias_{index}")]
        nodes += [helper.make_node("MatMul", [current, f"kernel_{index}"], [f"matmul_{index}"]),
                  helper.make_node("Add", [f"matmul_{index}", f"bias_{index}"], [f"dense_{index}"])]
        current = f"dense_{index}"
        if index < len(layers) - 1 and ACTIVATIONS[hidden_activation] is not None:
            nodes.append(helper.make_node(ACTIVATIONS[hidden_activation], [current], [f"act_{index}"]))
            current = f"act_{index}"
    nodes.append(helper.make_node("Softmax", [current], ["probabilities"], axis=-1))
    features, classes = layers[0][0].shape[0], layers[-1][0].shape[1]
    graph = helper.make_graph(
        nodes, "federated_classifier",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", classes])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="fl-coordinator")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def serving_config(name: str, weights: Weights, *, max_batch_size: int = 32, p99_ms: float = 25.0,
                   expected_rate_rps: float = 50.0, pool_kinds: Sequence[str] = ("cpu",)) -> str:
    """The inference-router's ``model.yaml`` (Triton's field names) for :func:`dense_classifier_onnx`'s
    model: a dynamic batch dimension, fp32, served on ``pool_kinds`` within ``p99_ms``. Checked with the
    router's contract before it is written, so a bundle never carries a config the router refuses.

    Raises:
        InvalidArgument: the config breaks a rule of the router's (the field is its path, e.g. ``name``).
    """
    import yaml

    # Imported here: the contract brings the router's client and its performance models (scikit-learn),
    # which only an export needs.
    from opml_inference_router_contract.model_config import ModelConfig

    features, classes = int(weights[0].shape[0]), int(weights[-2].shape[1])
    document = {"name": name, "max_batch_size": max_batch_size,
                "inputs": [{"name": "input", "data_type": "fp32", "dims": [features]}],
                "outputs": [{"name": "probabilities", "data_type": "fp32", "dims": [classes]}],
                "dynamic_batching": {"max_queue_delay_us": 2000}, "slo": {"p99_ms": p99_ms},
                "expected_rate_rps": expected_rate_rps, "pool_kinds": list(pool_kinds), "precisions": ["fp32"]}
    ModelConfig.from_dict(document)
    return yaml.safe_dump(document, sort_keys=False)
