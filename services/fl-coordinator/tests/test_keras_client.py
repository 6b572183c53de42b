"""KerasClient: local Keras training with FedProx's proximal term and partial work."""

from __future__ import annotations

import keras
import numpy as np

from opml_fl_coordinator.simulator import partition_digits
from opml_fl_coordinator.weights import global_norm, subtract
from opml_fl_coordinator_contract.keras_client import KerasClient


def client(seed=0, metrics=("accuracy",)) -> KerasClient:
    keras.utils.set_random_seed(seed)
    x, y = partition_digits(4, alpha=1.0).clients[0]
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=list(metrics))
    return KerasClient(model, x, y, seed=seed)


def test_fit_trains_and_evaluate_reports_accuracy():
    member = client()
    start = member.get_weights({})
    before = member.evaluate(start, {})
    trained, examples, metrics = member.fit(start, {"epochs": 3, "batch_size": 16, "learning_rate": 0.2})
    after = member.evaluate(trained, {})
    assert examples == 3 * len(member.y) and np.isfinite(metrics["train_loss"])
    assert after[0] < before[0] and after[2]["accuracy"] > before[2]["accuracy"]


def test_the_proximal_term_keeps_the_update_near_the_global_model():
    start = client().get_weights({})
    free, _, _ = client().fit(start, {"epochs": 3, "batch_size": 16, "learning_rate": 0.2})
    held, _, _ = client().fit(start, {"epochs": 3, "batch_size": 16, "learning_rate": 0.2, "proximal_mu": 5.0})
    assert global_norm(subtract(held, start)) < 0.8 * global_norm(subtract(free, start))


def test_no_time_left_means_no_work_done():
    member = client()
    start = member.get_weights({})
    trained, examples, metrics = member.fit(start, {"epochs": 5, "batch_size": 16, "time_budget_s": 0.0})
    assert examples == 1 and all(np.array_equal(a, b) for a, b in zip(trained, start))
    assert metrics == {}, "no NaN loss: the coordinator refuses an upload with a non-finite metric"


def test_a_model_compiled_without_accuracy_reports_none():
    member = client(metrics=())
    loss, _, metrics = member.evaluate(member.get_weights({}), {})
    assert np.isfinite(loss) and metrics == {}
