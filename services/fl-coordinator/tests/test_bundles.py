"""What a federation's published bundle holds and whether it is served: the federation's `serve`, else
the service's SERVE_MODELS; a dense classifier also goes as ONNX with its model.yaml and the default
monitoring.yaml the monitoring-scorer accepts. A real bundle-store."""

from __future__ import annotations

import numpy as np
import yaml

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import AlreadyExists
from opml_devstack.testing.services import TOKENS
from opml_fl_coordinator.bundles import BundlePublisher
from opml_fl_coordinator.config import parse_config
from opml_fl_coordinator.federation import RoundRecord, new_federation
from opml_fl_coordinator.monitoring import monitoring_config

WEIGHTS = [np.zeros((4, 3), np.float32), np.zeros(3, np.float32), np.zeros((3, 2), np.float32),
           np.zeros(2, np.float32)]


async def _published(store, name: str, document: dict, *, service_serves: bool) -> tuple[dict, set[str]]:
    config = parse_config({"name": name, "selection": {"clients_per_round": 2}, **document})
    federation = new_federation(name, config, now=0.0)
    publisher = BundlePublisher(store.target, token=TOKENS["writer"], context="federated", serve=service_serves)
    reference = await publisher.publish(federation, RoundRecord(1, 0.0, 1.0, participants=["a"]), WEIGHTS)
    with BundleStoreClient(store.target, token=TOKENS["reader"]) as client:
        bundle = client.get_bundle("federated", reference.rpartition("@")[2])
    return dict(bundle.tags), {f.path for f in bundle.files}


async def test_a_federations_serve_wins_and_the_services_setting_is_the_default(start_service):
    store = start_service("bundle-store")
    cases = {"unset-service-on": ({}, True, True), "unset-service-off": ({}, False, False),
             "off-service-on": ({"serve": False}, True, False), "on-service-off": ({"serve": True}, False, True)}
    for name, (document, service_serves, served) in cases.items():
        tags, files = await _published(store, name, document, service_serves=service_serves)
        assert (tags.get("serve") == "true") is served, name
        assert {"weights.npz", "model.onnx", "model.yaml", "monitoring.yaml"} <= files, name
        assert "reference.npz" not in files  # no holdout named: nothing to make one of


async def test_a_model_that_is_not_a_dense_classifier_is_committed_but_never_served(start_service):
    store = start_service("bundle-store")
    config = parse_config({"name": "odd", "selection": {"clients_per_round": 2}, "serve": True})
    publisher = BundlePublisher(store.target, token=TOKENS["writer"], context="federated")
    reference = await publisher.publish(new_federation("odd", config, now=0.0), RoundRecord(1, 0.0, 1.0),
                                        [np.zeros((2, 2, 2), np.float32)])
    with BundleStoreClient(store.target, token=TOKENS["reader"]) as client:
        bundle = client.get_bundle("federated", reference.rpartition("@")[2])
    assert "serve" not in bundle.tags and {f.path for f in bundle.files} == {"weights.npz"}


def test_the_default_monitoring_config_is_one_the_monitoring_scorer_accepts():
    from opml_monitoring_scorer.core.config import MonitoringConfig

    config = MonitoringConfig.parse(monitoring_config(columns=4))
    assert config.scores_output == "probabilities" and {rule.signal for rule in config.rules} == {
        "drift", "data_quality"}


def test_the_bad_input_bound_is_above_what_clean_rows_of_a_wide_model_show():
    """256 pixel columns against ranges from a 500-row first window: most clean rows fall outside some
    column's range, so a fixed 5 % bound alerted on every clean window; the bound is above that share."""
    from opml_monitoring_scorer_contract.reference import clean_bad_share

    narrow, wide = (yaml.safe_load(monitoring_config(columns=columns)) for columns in (4, 256))
    [narrow_bound] = [r["over"] for r in narrow["rules"] if r["signal"] == "data_quality"]
    [wide_bound] = [r["over"] for r in wide["rules"] if r["signal"] == "data_quality"]
    assert narrow_bound < 0.1 and wide_bound > clean_bad_share(256, 500) > 0.5
    assert not [r for r in yaml.safe_load(monitoring_config(columns=4096, reference_rows=100))["rules"]
                if r["signal"] == "data_quality"], "no bound where the range check cannot tell"


def test_with_a_holdout_the_config_adds_a_rule_on_the_estimated_accuracy_the_scorer_accepts():
    from opml_monitoring_scorer.core.config import MonitoringConfig

    config = MonitoringConfig.parse(monitoring_config(columns=4, reference_rows=200, holdout_accuracy=0.9))
    (rule,) = [r for r in config.rules if r.signal == "mpp"]
    assert rule.name == "accuracy-low"


def _holdout_bundle(store, name: str, files: dict[str, bytes]) -> None:
    with BundleStoreClient(store.target, token=TOKENS["writer"]) as client:
        try:
            client.create_context("holdouts")
        except AlreadyExists:
            pass
        client.add("holdouts", name, files, commit=True)


async def test_a_named_holdout_makes_the_reference_set_the_scorer_loads_with_the_models_outputs(start_service):
    import io

    from opml_fl_coordinator.holdout import probabilities
    from opml_monitoring_scorer.core.scorer import load_reference

    store = start_service("bundle-store")
    rng = np.random.default_rng(0)
    weights = [rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32),
               rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=2).astype(np.float32)]
    x = rng.normal(size=(200, 4)).astype(np.float32)
    truth = probabilities(weights, x, hidden_activation="tanh").argmax(axis=1)
    y = np.where(np.arange(200) < 150, truth, 1 - truth)  # the model is right on 150 of 200 rows
    buffer = io.BytesIO()
    np.savez(buffer, x=x, y=y)
    _holdout_bundle(store, "plant-holdout", {"holdout.npz": buffer.getvalue()})
    config = parse_config({"name": "held", "selection": {"clients_per_round": 2}, "model": {"hidden_activation": "tanh"},
                           "holdout": {"context": "holdouts", "bundle": "plant-holdout"}})
    publisher = BundlePublisher(store.target, token=TOKENS["writer"], context="federated")
    published = await publisher.publish(new_federation("held", config, now=0.0), RoundRecord(1, 0.0, 1.0), weights)

    with BundleStoreClient(store.target, token=TOKENS["reader"]) as client:
        bundle = client.get_bundle("federated", published.rpartition("@")[2])
        data = b"".join(client.read_file("federated", bundle.uuid, "reference.npz"))
        rules = b"".join(client.read_file("federated", bundle.uuid, "monitoring.yaml")).decode()
    reference = load_reference(data, task=None)
    assert set(reference.features) == {f"input[{i}]" for i in range(4)}
    np.testing.assert_array_equal(reference.outputs.predicted, truth)
    np.testing.assert_array_equal(reference.labels, y)
    assert bundle.values["holdout.accuracy"].float_value == 0.75
    assert "accuracy-low" in rules and "0.65" in rules


async def test_a_holdout_that_does_not_fit_the_model_leaves_the_model_published_without_a_reference(start_service):
    import io

    store = start_service("bundle-store")
    buffer = io.BytesIO()
    np.savez(buffer, x=np.zeros((10, 7), np.float32), y=np.zeros(10, np.int64))  # 7 features, the model takes 4
    _holdout_bundle(store, "wide-holdout", {"holdout.npz": buffer.getvalue()})
    config = parse_config({"name": "wide", "selection": {"clients_per_round": 2}, "serve": True,
                           "holdout": {"context": "holdouts", "bundle": "wide-holdout"}})
    publisher = BundlePublisher(store.target, token=TOKENS["writer"], context="federated")
    published = await publisher.publish(new_federation("wide", config, now=0.0), RoundRecord(1, 0.0, 1.0), WEIGHTS)
    with BundleStoreClient(store.target, token=TOKENS["reader"]) as client:
        bundle = client.get_bundle("federated", published.rpartition("@")[2])
    assert bundle.tags["serve"] == "true" and "reference.npz" not in {f.path for f in bundle.files}
