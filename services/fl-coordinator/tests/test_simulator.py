"""The simulator runs the coordinator's own federation code with 100+ virtual clients."""

from __future__ import annotations

import numpy as np

from opml_fl_coordinator.config import parse_config
from opml_fl_coordinator.simulator import Simulator, heterogeneous_traits, partition_digits


def config(**overrides):
    document = {"name": "sim", "rounds": 40, "min_clients": 120, "round_deadline_s": 30,
                "selection": {"clients_per_round": 10, "tiers": 5},
                "semi_async": {"buffer_size": 10, "concurrency": 20},
                "local": {"epochs": 2, "batch_size": 16, "learning_rate": 0.1}, **overrides}
    return parse_config(document)


def run(seed=0, **overrides):
    partition = partition_digits(120, alpha=0.5, seed=seed)
    return Simulator(config(**overrides), partition, heterogeneous_traits(120, seed=seed), seed=seed).run()


def test_data_is_non_iid_and_of_unequal_sizes():
    partition = partition_digits(120, alpha=0.3, seed=1)
    sizes = [len(y) for _, y in partition.clients]
    assert min(sizes) >= 4 and max(sizes) > 3 * np.median(sizes)
    label_counts = [len(np.unique(y)) for _, y in partition.clients]
    assert np.median(label_counts) < 8  # skewed: most clients see few of the 10 digits


def test_120_virtual_clients_learn_digits_and_a_seed_repeats_exactly():
    first = run(seed=3)
    assert len(first.rounds) == 40 and first.accuracy[-1] > 0.8
    again = run(seed=3)
    assert again.accuracy == first.accuracy and again.times == first.times
    assert run(seed=4).accuracy != first.accuracy


def test_stragglers_and_dropouts_shape_the_rounds():
    result = run(seed=0)
    assert any(r.dropped for r in result.rounds), "5% drop-outs over 400 tasks drop some"
    assert all("deadline" in reason for r in result.rounds for reason in r.dropped.values())
    partial = run(seed=0, stragglers="partial", round_deadline_s=0.8)
    assert all(r.duration_s <= 0.8 + 1e-9 for r in partial.rounds)
    assert partial.accuracy[-1] > 0.5  # partial work still trains


def test_every_mode_and_policy_runs_on_the_same_code():
    for overrides in ({"selection": {"policy": "tifl", "clients_per_round": 10, "tiers": 5}},
                      {"mode": "semi_async"},
                      {"strategy": {"name": "fedprox", "proximal_mu": 0.01}},
                      {"strategy": {"name": "median"}}):
        result = run(seed=1, **overrides)
        assert result.accuracy[-1] > 0.6, overrides
