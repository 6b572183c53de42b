"""What each strategy computes, against the formulas of its paper."""

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
)
from opml_fl_coordinator.strategy.bounded import lower_median
from opml_fl_coordinator.strategy.fedopt import FedOpt
from opml_fl_coordinator.weights import global_norm, subtract


def res(cid, value, n):
    return FitRes(cid, [np.full((2,), value, np.float64)], num_examples=n)


def test_fedavg_weights_by_examples():
    aggregated, _ = FedAvg().aggregate_fit(1, [res("a", 1.0, 10), res("b", 4.0, 30)], [])
    np.testing.assert_allclose(aggregated[0], [3.25, 3.25])


def test_fedavg_min_results_and_failures():
    assert FedAvg(min_fit_results=3).aggregate_fit(1, [res("a", 1, 1), res("b", 2, 1)], [])[0] is None
    assert FedAvg(accept_failures=False).aggregate_fit(1, [res("a", 1, 1)], [Failure("b", "late")])[0] is None
    assert FedAvg().aggregate_fit(1, [res("a", 1, 1)], [Failure("b", "late")])[0] is not None


def test_fedprox_sends_mu_and_the_callable_config():
    strategy = FedProx(proximal_mu=0.01, on_fit_config_fn=lambda r: {"epochs": r})
    (ins,) = strategy.configure_fit(2, [np.zeros(2)], ["a"])
    assert ins.config == {"epochs": 2, "server_round": 2, "proximal_mu": 0.01}


def test_trimmed_mean_ignores_an_outlier_and_median_too():
    results = [res("a", 1.0, 1), res("b", 1.2, 1), res("c", 0.8, 1), res("d", 1000.0, 1000), res("e", 1.0, 1)]
    trimmed, _ = FedTrimmedAvg(beta=0.2).aggregate_fit(1, results, [])
    np.testing.assert_allclose(trimmed[0], [(1.0 + 1.2 + 1.0) / 3] * 2)
    median, _ = FedMedian().aggregate_fit(1, results, [])
    np.testing.assert_allclose(median[0], [1.0, 1.0])


def test_fedadam_first_step_is_eta_times_the_sign_scaled_update():
    """m = (1-b1) d, v = (1-b2) d^2, w' = w + eta m / (sqrt v + tau)."""
    strategy = FedAdam(eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3)
    strategy.initialize([np.zeros(2)])
    aggregated, _ = strategy.aggregate_fit(1, [res("a", 0.5, 1)], [])
    m, v = 0.1 * 0.5, 0.01 * 0.25
    np.testing.assert_allclose(aggregated[0], [0.1 * m / (np.sqrt(v) + 1e-3)] * 2)


def test_fedyogi_second_moment_differs_from_adam_after_two_steps():
    adam, yogi = FedAdam(eta=0.1), FedYogi(eta=0.1)
    for strategy in (adam, yogi):
        strategy.initialize([np.zeros(2)])
        strategy.aggregate_fit(1, [res("a", 0.5, 1)], [])
        strategy.aggregate_fit(2, [res("a", 2.0, 1)], [])
    assert not np.allclose(adam.v_t[0], yogi.v_t[0])
    # Yogi: v1 = 0 - (1-b2) d^2 sign(0 - d^2) = (1-b2) d^2 > 0, as Adam's on the first step
    assert np.all(yogi.v_t[0] > 0)


def _subclasses(cls: type) -> list[type]:
    return [sub for direct in cls.__subclasses__() for sub in (direct, *_subclasses(direct))]


def test_fedopt_is_abstract_and_every_server_optimizer_can_be_made():
    """FedOpt has no second-moment rule, so it cannot be made (it used to be, and failed at its first
    aggregation); each of its concrete subclasses can, with FedOpt's own arguments."""
    with pytest.raises(TypeError, match="abstract"):
        FedOpt(eta=0.1)
    concrete = [cls for cls in _subclasses(FedOpt) if not getattr(cls, "__abstractmethods__", None)]
    assert {FedAdam, FedYogi} <= set(concrete)
    for cls in concrete:
        strategy = cls(eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3)
        strategy.initialize([np.zeros(2)])
        assert strategy.aggregate_fit(1, [res("a", 0.5, 1)], [])[0] is not None


def test_dp_clips_every_update_and_adds_calibrated_noise():
    base = [np.zeros(1000)]
    inner = FedAvg()
    dp = DifferentialPrivacyFixedClipping(inner, noise_multiplier=0.0, clipping_norm=1.0, num_sampled_clients=2)
    dp.configure_fit(1, base, ["a", "b"])
    big = FitRes("a", [np.full(1000, 5.0)], num_examples=1)
    assert global_norm(subtract(dp.clip(big).weights, base)) == pytest.approx(1.0)
    small = FitRes("b", [np.full(1000, 0.001)], num_examples=1)
    assert global_norm(subtract(dp.clip(small).weights, base)) == pytest.approx(global_norm(small.weights))
    noisy = DifferentialPrivacyFixedClipping(FedAvg(), noise_multiplier=2.0, clipping_norm=1.0, num_sampled_clients=4,
                                             seed=1)
    noisy.configure_fit(1, base, ["a"])
    aggregated, metrics = noisy.aggregate_fit(1, [FitRes("a", [np.zeros(1000)], num_examples=1)], [])
    assert metrics["dp_noise_stddev"] == pytest.approx(0.5)
    assert np.std(aggregated[0]) == pytest.approx(0.5, rel=0.1)


def test_bounded_influence_holds_a_member_claiming_ten_million_examples_to_its_share_of_the_clip():
    """The attack of a security review: one member of five shifts every weight by +0.03 and claims
    10,000,000 examples. FedAvg moved the model by +0.03 a weight. Bounded, the member's change is
    clipped to 2x the round's median change and its count capped at 3x the median count, so it
    moves the model at most its share, 3*100 / (3*100 + 4*100), of the clip bound; the honest
    members' round aggregates as FedAvg's."""
    rng = np.random.default_rng(7)
    base = [np.zeros(1000)]
    honest = [FitRes(f"h{i}", [base[0] + rng.normal(0.0, 0.01, 1000)], num_examples=100) for i in range(4)]
    attacker = FitRes("a", [base[0] + 0.03], num_examples=10_000_000)
    plain, _ = FedAvg().aggregate_fit(1, [*honest, attacker], [])
    assert np.mean(plain[0]) > 0.0299  # the attack, unbounded

    bounded = BoundedInfluence(FedAvg(), clip_factor=2.0, weight_factor=3.0)
    bounded.configure_fit(1, base, ["h0", "h1", "h2", "h3", "a"])
    attacked, metrics = bounded.aggregate_fit(1, [*honest, attacker], [])
    clean, clean_metrics = bounded.aggregate_fit(1, honest, [])
    assert (metrics["updates_clipped"], metrics["examples_capped"]) == (1, 1)
    assert (clean_metrics["updates_clipped"], clean_metrics["examples_capped"]) == (0, 0)
    np.testing.assert_allclose(clean[0], FedAvg().aggregate_fit(1, honest, [])[0][0])

    clip = 2.0 * lower_median([global_norm(subtract(r.weights, base)) for r in [*honest, attacker]])
    share = 3 * 100 / (3 * 100 + 4 * 100)
    # the attacked aggregate is the honest one moved towards the clipped update by the member's share
    assert global_norm(subtract(attacked, clean)) <= share * (clip + global_norm(subtract(clean, base))) + 1e-12
    per_weight = float(np.mean(attacked[0] - base[0]))
    assert per_weight <= share * clip / np.sqrt(1000) + abs(float(np.mean(clean[0] - base[0])))
    assert per_weight < 0.01  # from +0.03


def test_bounded_influence_takes_the_lower_median_so_one_of_two_cannot_set_its_own_bound():
    base = [np.zeros(4)]
    bounded = BoundedInfluence(FedAvg(), clip_factor=2.0, weight_factor=3.0)
    bounded.configure_fit(1, base, ["h", "a"])
    results = [FitRes("h", [np.full(4, 0.1)], num_examples=10), FitRes("a", [np.full(4, 50.0)], num_examples=10**7)]
    (honest, attacker), clipped, capped = bounded.bound(results)
    assert (clipped, capped) == (1, 1) and honest is results[0]
    np.testing.assert_allclose(attacker.weights[0], 0.2)  # 2x the smaller change
    assert attacker.num_examples == 30
