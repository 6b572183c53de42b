"""What a federation's published bundle holds and whether it is served: the federation's `serve`, else
the service's SERVE_MODELS; a dense classifier also goes as ONNX with its model.yaml and the default
monitoring.yaml the monitoring-scorer accepts. A real bundle-store."""

from __future__ import annotations

import numpy as np

from opml_bundle_store_contract.client import BundleStoreClient
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
        assert "reference.npz" not in files  # the coordinator holds no data to make one of


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

    config = MonitoringConfig.parse(monitoring_config())
    assert config.scores_output == "probabilities" and {rule.signal for rule in config.rules} == {
        "drift", "data_quality"}
