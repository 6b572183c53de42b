"""Federation configs: every wrong field path at once, YAML errors with line and column."""

from __future__ import annotations

import pytest

from opml_common.errors import InvalidArgument
from opml_fl_coordinator.config import build_selection, build_strategy, parse_config
from opml_fl_coordinator.selection import TiflSelection
from opml_fl_coordinator.strategy import BoundedInfluence, DifferentialPrivacyFixedClipping, FedAvg, FedYogi

GOOD = """
name: plants
rounds: 5
min_clients: 4
strategy: {name: fedyogi, eta: 0.05, differential_privacy: {noise_multiplier: 0.5, clipping_norm: 2.0}}
selection: {policy: tifl, clients_per_round: 3, tiers: 2}
"""


def test_a_good_config_builds_its_strategy_and_selection():
    config = parse_config(GOOD)
    strategy = build_strategy(config)
    assert isinstance(strategy, BoundedInfluence)  # untrusted unless the config says otherwise
    assert (strategy.clip_factor, strategy.weight_factor) == (2.0, 3.0)
    private = strategy.strategy
    assert isinstance(private, DifferentialPrivacyFixedClipping) and isinstance(private.strategy, FedYogi)
    assert private.num_sampled_clients == 3
    assert isinstance(build_selection(config), TiflSelection)


def test_only_a_trusted_federation_aggregates_without_bounds_on_each_update():
    small = {"name": "p", "selection": {"clients_per_round": 2}}
    assert type(build_strategy(parse_config({**small, "trust": "trusted"}))) is FedAvg
    tuned = build_strategy(parse_config({**small, "robust": {"clip_factor": 1.5, "weight_factor": 1.0}}))
    assert isinstance(tuned, BoundedInfluence) and (tuned.clip_factor, tuned.weight_factor) == (1.5, 1.0)
    with pytest.raises(InvalidArgument) as caught:
        parse_config({**small, "trust": "trusted", "robust": {"clip_factor": 3}})
    assert caught.value.violations == (("robust", "applies to untrusted federations only, but trust is 'trusted'"),)
    with pytest.raises(InvalidArgument) as caught:
        parse_config({**small, "trust": "some", "robust": {"clip_factor": 0.5, "weight_factor": 0}})
    assert {f for f, _ in caught.value.violations} == {"trust", "robust.clip_factor", "robust.weight_factor"}


def test_every_wrong_field_is_named_at_once():
    text = """
name: Plants!
rounds: 0
strategy: {name: fedadam, eta: -1, colour: red}
selection: {policy: best, clients_per_round: 0}
local: {epochs: 0}
unknown: 1
"""
    with pytest.raises(InvalidArgument) as caught:
        parse_config(text)
    fields = [field for field, _ in caught.value.violations]
    assert set(fields) == {"name", "rounds", "strategy.eta", "strategy.colour", "selection.policy",
                           "selection.clients_per_round", "local.epochs", "unknown"}
    assert "is not a known field" in dict(caught.value.violations)["unknown"]


def test_rules_between_fields_are_reported_together():
    with pytest.raises(InvalidArgument) as caught:
        parse_config({"name": "p", "min_clients": 2, "selection": {"clients_per_round": 3},
                      "strategy": {"name": "fedavg", "min_fit_results": 5}})
    assert [f for f, _ in caught.value.violations] == ["selection.clients_per_round", "strategy.min_fit_results"]
    # semi-async: a version aggregates one buffer, so more results than it holds would never aggregate
    with pytest.raises(InvalidArgument) as caught:
        parse_config({"name": "p", "mode": "semi_async", "min_clients": 4, "semi_async": {"buffer_size": 2},
                      "strategy": {"name": "fedavg", "min_fit_results": 3}})
    assert [f for f, _ in caught.value.violations] == ["strategy.min_fit_results"]
    assert "semi_async.buffer_size (2)" in caught.value.message


def test_an_unknown_strategy_and_bad_yaml():
    with pytest.raises(InvalidArgument) as caught:
        parse_config({"name": "p", "strategy": {"name": "fedsgd"}})
    assert caught.value.violations[0][0] == "strategy"
    with pytest.raises(InvalidArgument, match=r"fed.yaml: is not valid YAML.*line 3, column 1"):
        parse_config("name: p\nrounds: [1,\n", what="fed.yaml")
    with pytest.raises(InvalidArgument, match="at most"):
        parse_config("name: " + "x" * 70_000)


def test_the_model_and_serve_fields_default_to_a_relu_stack_and_the_services_choice():
    small = {"name": "p", "selection": {"clients_per_round": 2}}
    config = parse_config(small)
    assert config.model.hidden_activation == "relu" and config.serve is None
    chosen = parse_config({**small, "model": {"hidden_activation": "tanh"}, "serve": False})
    assert chosen.model.hidden_activation == "tanh" and chosen.serve is False
    with pytest.raises(InvalidArgument) as caught:
        parse_config({**small, "model": {"hidden_activation": "gelu"}, "serve": "sometimes"})
    assert [field for field, _ in caught.value.violations] == ["model.hidden_activation", "serve"]
