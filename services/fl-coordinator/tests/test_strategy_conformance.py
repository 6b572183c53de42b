"""One conformance suite run against every aggregation strategy (docs/adding-a-service.md)."""

from __future__ import annotations

import numpy as np
import pytest

from opml_fl_coordinator.strategy import (
    BoundedInfluence,
    DifferentialPrivacyFixedClipping,
    Failure,
    FedAdam,
    FedAvg,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    FedYogi,
    FitRes,
    Strategy,
)
from opml_fl_coordinator.weights import subtract

FACTORIES = {
    "fedavg": lambda: FedAvg(),
    "fedprox": lambda: FedProx(proximal_mu=0.1),
    "fedadam": lambda: FedAdam(eta=0.05),
    "fedyogi": lambda: FedYogi(eta=0.05),
    "trimmed_mean": lambda: FedTrimmedAvg(beta=0.2),
    "median": lambda: FedMedian(),
    "dp(fedavg)": lambda: DifferentialPrivacyFixedClipping(FedAvg(), noise_multiplier=0.0, clipping_norm=100.0,
                                                           num_sampled_clients=5, seed=0),
    "bounded(fedavg)": lambda: BoundedInfluence(FedAvg(), clip_factor=2.0, weight_factor=3.0),
    "bounded(fedadam)": lambda: BoundedInfluence(FedAdam(eta=0.05), clip_factor=2.0, weight_factor=3.0),
}
BAD_CONFIG = {
    "fedavg": lambda: FedAvg(min_fit_results=0),
    "fedprox": lambda: FedProx(proximal_mu=-1.0),
    "fedadam": lambda: FedAdam(eta=0.0),
    "fedyogi": lambda: FedYogi(beta_2=1.0),
    "trimmed_mean": lambda: FedTrimmedAvg(beta=0.5),
    "median": lambda: FedMedian(on_fit_config_fn=3),
    "dp(fedavg)": lambda: DifferentialPrivacyFixedClipping(FedAvg(), noise_multiplier=1.0, clipping_norm=0.0,
                                                           num_sampled_clients=5),
    "bounded(fedavg)": lambda: BoundedInfluence(FedAvg(), clip_factor=0.5, weight_factor=3.0),
    "bounded(fedadam)": lambda: BoundedInfluence(FedAdam(eta=0.05), clip_factor=2.0, weight_factor=float("inf")),
}


@pytest.fixture(params=sorted(FACTORIES))
def name(request) -> str:
    return request.param


def model(rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(3,)).astype(np.float32)]


def results_around(weights, rng, n=5, shift=0.5, spread=0.01) -> list[FitRes]:
    return [FitRes(f"c{i}", [w + shift + rng.normal(scale=spread, size=w.shape).astype(w.dtype) for w in weights],
                   num_examples=10 + i, metrics={"accuracy": 0.5 + i / 100})
            for i in range(n)]


def started(name: str, weights) -> Strategy:
    strategy = FACTORIES[name]()
    weights = strategy.initialize(weights)
    strategy.configure_fit(1, weights, [f"c{i}" for i in range(5)])
    return strategy


def test_configure_fit_gives_each_selected_client_the_model_and_the_round(name):
    weights = model(np.random.default_rng(0))
    strategy = FACTORIES[name]()
    strategy.initialize(weights)
    instructions = strategy.configure_fit(3, weights, ["b", "a", "c"])
    assert [ins.client_id for ins in instructions] == ["b", "a", "c"]
    for ins in instructions:
        assert all(np.array_equal(x, y) for x, y in zip(ins.weights, weights))
        assert ins.config["server_round"] == 3
    with pytest.raises(ValueError, match="server_round"):
        strategy.configure_fit(0, weights, ["a"])


def test_clients_that_agree_with_the_model_leave_it_where_it_is(name):
    weights = model(np.random.default_rng(1))
    strategy = started(name, weights)
    same = [FitRes(f"c{i}", [w.copy() for w in weights], num_examples=5) for i in range(5)]
    aggregated, _ = strategy.aggregate_fit(1, same, [])
    assert [a.shape for a in aggregated] == [w.shape for w in weights]
    assert [a.dtype for a in aggregated] == [w.dtype for w in weights]
    for a, w in zip(aggregated, weights):
        np.testing.assert_allclose(a, w, atol=1e-6)


def test_the_model_moves_towards_where_the_clients_went(name):
    rng = np.random.default_rng(2)
    weights = model(rng)
    strategy = started(name, weights)
    aggregated, metrics = strategy.aggregate_fit(1, results_around(weights, rng), [])
    moved = np.concatenate([d.ravel() for d in subtract(aggregated, weights)])
    assert np.all(moved > 0), "every coordinate moved in the direction of the clients' common shift"
    assert 0.5 <= metrics["accuracy"] <= 0.55


def test_the_order_of_results_does_not_matter(name):
    rng = np.random.default_rng(3)
    weights = model(rng)
    results = results_around(weights, rng, spread=0.3)
    first, _ = started(name, weights).aggregate_fit(1, results, [])
    second, _ = started(name, weights).aggregate_fit(1, results[::-1], [])
    for a, b in zip(first, second):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_no_results_keep_the_model(name):
    weights = model(np.random.default_rng(4))
    aggregated, metrics = started(name, weights).aggregate_fit(1, [], [Failure("c0", "dropped")])
    assert aggregated is None


def test_weights_of_different_shapes_are_refused(name):
    rng = np.random.default_rng(5)
    weights = model(rng)
    results = results_around(weights, rng)
    results[2].weights = [np.zeros((2, 2), np.float32), weights[1]]
    with pytest.raises(ValueError, match="c2"):
        started(name, weights).aggregate_fit(1, results, [])


def test_saved_state_continues_exactly(name):
    """A strategy rebuilt from the saved model and state() aggregates the next round the same."""
    rng = np.random.default_rng(6)
    weights = model(rng)
    running = started(name, weights)
    after_one, _ = running.aggregate_fit(1, results_around(weights, rng), [])
    second_round = results_around(after_one, rng)
    restored = FACTORIES[name]()
    restored.initialize(after_one)
    restored.load_state(running.state())
    restored.configure_fit(2, after_one, ["c0"])
    running.configure_fit(2, after_one, ["c0"])
    expected, _ = running.aggregate_fit(2, second_round, [])
    got, _ = restored.aggregate_fit(2, second_round, [])
    for a, b in zip(expected, got):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_configuration_is_keyword_only_and_checked_in_init(name):
    with pytest.raises(ValueError):
        BAD_CONFIG[name]()
    with pytest.raises(TypeError):
        type(FACTORIES[name]())(1)  # positional configuration is refused
