"""The global model as ONNX: what onnxruntime computes from it is what Keras and numpy compute."""

from __future__ import annotations

import keras
import numpy as np
import onnxruntime as ort
import pytest

from opml_fl_coordinator.onnx_export import ACTIVATIONS, dense_classifier_onnx
from opml_fl_coordinator.simulator import SoftmaxModel


def run(model_bytes: bytes, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    return session.run(["probabilities"], {"input": x})[0]


def test_a_keras_mlp_and_its_onnx_agree():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    x = np.random.default_rng(0).random((7, 64), dtype=np.float32)
    np.testing.assert_allclose(run(dense_classifier_onnx(model.get_weights()), x), model.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_the_simulators_softmax_regression_and_its_onnx_agree():
    rng = np.random.default_rng(1)
    weights = [rng.normal(size=(64, 10)).astype(np.float32), rng.normal(size=10).astype(np.float32)]
    x = rng.random((5, 64), dtype=np.float32)
    expected = SoftmaxModel(64, 10)._probabilities(weights, x)
    np.testing.assert_allclose(run(dense_classifier_onnx(weights), x), expected, rtol=1e-5, atol=1e-6)


def test_weights_that_are_not_a_dense_stack_are_refused():
    with pytest.raises(ValueError, match="pairs"):
        dense_classifier_onnx([np.zeros((3, 2), np.float32)])
    with pytest.raises(ValueError, match="layer 1 takes 4"):
        dense_classifier_onnx([np.zeros((3, 2)), np.zeros(2), np.zeros((4, 2)), np.zeros(2)])


def test_the_serving_config_is_one_the_inference_router_accepts():
    import yaml

    from opml_fl_coordinator.onnx_export import serving_config
    from opml_inference_router_contract.model_config import ModelConfig

    weights = [np.zeros((64, 32)), np.zeros(32), np.zeros((32, 10)), np.zeros(10)]
    config = ModelConfig.from_dict(yaml.safe_load(serving_config("fl-plants", weights)))
    assert config.name == "fl-plants" and config.max_batch_size == 32
    assert [tuple(i.dims) for i in config.inputs] == [(64,)] and [tuple(o.dims) for o in config.outputs] == [(10,)]


def test_a_serving_config_the_inference_router_would_refuse_is_never_written():
    from opml_common.errors import InvalidArgument
    from opml_fl_coordinator.onnx_export import serving_config

    weights = [np.zeros((4, 2)), np.zeros(2)]
    with pytest.raises(InvalidArgument) as caught:
        serving_config("fl plants", weights)
    assert caught.value.field == "name"
    with pytest.raises(InvalidArgument, match="pool kinds must be unique"):
        serving_config("fl-plants", weights, pool_kinds=("cpu", "cpu"))


def _forward(weights, x, activation):
    """numpy's forward pass of a dense classifier: ``activation`` on the hidden layers, softmax last."""
    hidden = {"relu": lambda z: np.maximum(z, 0), "tanh": np.tanh, "sigmoid": lambda z: 1 / (1 + np.exp(-z)),
              "linear": lambda z: z}[activation]
    for index in range(0, len(weights), 2):
        x = x @ weights[index] + weights[index + 1]
        if index < len(weights) - 2:
            x = hidden(x)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_every_activation_a_federation_may_name_is_exported_as_numpy_computes_it(activation):
    from typing import get_args

    from opml_fl_coordinator.config import ModelSpec

    assert set(get_args(ModelSpec.model_fields["hidden_activation"].annotation)) == set(ACTIVATIONS)
    rng = np.random.default_rng(2)
    weights = [rng.normal(size=shape).astype(np.float32) for shape in ((12, 8), (8,), (8, 6), (6,), (6, 3), (3,))]
    x = rng.normal(size=(9, 12)).astype(np.float32)
    np.testing.assert_allclose(run(dense_classifier_onnx(weights, hidden_activation=activation), x),
                               _forward(weights, x, activation), rtol=1e-5, atol=1e-6)


def test_an_activation_with_no_export_is_refused_by_name():
    from opml_common.errors import InvalidArgument

    weights = [np.zeros((4, 3), np.float32), np.zeros(3, np.float32), np.zeros((3, 2), np.float32), np.zeros(2)]
    with pytest.raises(InvalidArgument) as caught:
        dense_classifier_onnx(weights, hidden_activation="gelu")
    assert caught.value.field == "model.hidden_activation"
    assert "layer 0" in str(caught.value) and "'gelu'" in str(caught.value)


@pytest.mark.parametrize("activation", ["relu", "tanh", "sigmoid", "linear"])
def test_the_holdouts_numpy_forward_pass_is_the_exported_graph(activation):
    from opml_fl_coordinator.holdout import probabilities

    rng = np.random.default_rng(7)
    weights = [rng.normal(size=(5, 8)).astype(np.float32), rng.normal(size=8).astype(np.float32),
               rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32)]
    x = rng.normal(size=(64, 5)).astype(np.float32)
    session = ort.InferenceSession(dense_classifier_onnx(weights, hidden_activation=activation),
                                   providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(probabilities(weights, x, hidden_activation=activation),
                               session.run(None, {"input": x})[0], rtol=1e-4, atol=1e-6)
