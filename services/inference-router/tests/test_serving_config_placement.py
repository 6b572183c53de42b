"""The serving configuration placement chooses per replica, end to end: a router process with its real
worker (real onnxruntime, Redis, the broker). Deployed with nothing measured, the replica runs the
worker's defaults and the deployment says so; once its configurations are measured, the router
re-places it with the configuration its performance model predicts best (what a chooser given the
router's own predictions picks), the worker's session runs with exactly those options (read back
from onnxruntime through the worker's ModelConfig), and a restart over the stored state restores them.
"""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import pytest
import tritonclient.grpc as triton
import yaml
from opml.inference.v1 import deployment_events_pb2 as events
from opml.inference.v1 import deployments_pb2 as pb

from opml_common.bus import CloudEvent
from opml_common.config import PlatformSettings
from opml_common.perfmodel import grid
from opml_devstack.testing.bus import read_records
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_inference_router.placement import (
    CostAwareSloPolicy,
    Fleet,
    FleetConfig,
    ModelDemand,
    ModelVersion,
    Profile,
    ServingConfigChooser,
    ServingTable,
)
from opml_inference_router.runtime import thread_share
from opml_inference_router.testing import mlp_classifier, mlp_config, write_model_dir
from opml_inference_router_contract.client import DeploymentClient
from opml_inference_router_contract.model_config import ModelConfig
from opml_inference_router_contract.topics import DEPLOYMENTS

VERSION = "models/mlp/versions/1"
# One cpu worker of one slot: the slot has the machine's cores (2 here), so threads 1 and 2 are candidates.
FLEET = {"pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 1, "cost_per_hour": 0.4,
                         "execution_provider": "CPUExecutionProvider"}],
         "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}], "min_replicas": 1}
GRID = list(grid(batches=(1, 4, 16), threads=(1, 2), opt_levels=("disable", "all"), precisions=("fp32",)))


@pytest.fixture
def router_env(start_service: ServiceStarter, tmp_path: Path) -> dict[str, str]:
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(FLEET))
    return start_service.env("inference-router", extra_env={
        "OPML_INFERENCE_ROUTER_FLEET": str(tmp_path / "fleet.yaml"),
        "OPML_INFERENCE_ROUTER_WORKER_TRANSPORT": "grpc",  # replica addresses the test can call
        "OPML_INFERENCE_ROUTER_WORKER_TOKEN": secrets.token_urlsafe(16),
        "OPML_INFERENCE_ROUTER_REPLAN_INTERVAL_S": "0"})


def sessions(version: pb.ModelVersionStatus) -> set[tuple[int, str, str]]:
    return {(r.session.threads, r.session.opt_level, r.session.execution_mode) for r in version.replicas}


def worker_sessions(version: pb.ModelVersionStatus, token: str) -> set[tuple[int, str, str]]:
    """What each replica's worker says its sessions run with (onnxruntime's own account)."""
    found = set()
    for replica in version.replicas:
        with triton.InferenceServerClient(replica.address) as worker:
            parameters = worker.get_model_config("mlp", "1", headers={"authorization": f"Bearer {token}"}
                                                 ).config.parameters
        found.add((int(parameters["opml_threads"].string_value), parameters["opml_opt_level"].string_value,
                   parameters["opml_execution_mode"].string_value))
    return found


def expected_choice(reader: DeploymentClient, version: pb.ModelVersionStatus, config: ModelConfig):
    """What a chooser picks from the router's own predictions and profile: the predicted best."""
    fleet = Fleet(FleetConfig.model_validate(FLEET))
    kind = fleet.kinds["cpu"]
    demand = ModelDemand(config, 1, config.expected_rate_rps)
    probe = ServingConfigChooser(fleet=fleet, policy=CostAwareSloPolicy(), slot_threads=lambda k: thread_share(kind),
                                 tables=lambda model, k: None)
    candidates = probe.candidates(demand, kind)
    predicted = reader.predict_serving_performance(VERSION, "cpu", candidates)
    table = ServingTable({c: p.latency_ms for c, p in zip(candidates, predicted.predictions, strict=True)}, "router")
    stored = next(p for p in version.profiles if p.pool_kind == "cpu")
    profile = Profile(ModelVersion("mlp", 1), "cpu", stored.precision, dict(stored.batch_latency_ms), stored.memory_mib)
    chooser = ServingConfigChooser(fleet=fleet, policy=CostAwareSloPolicy(), slot_threads=lambda k: thread_share(kind),
                                   tables=lambda model, k: table)
    _, chosen = chooser.choose(demand, kind, profile)
    return (chosen.threads, chosen.opt_level, chosen.execution_mode)


def test_a_replica_runs_the_configuration_its_performance_model_predicts_best(
        start_service: ServiceStarter, router_env: dict[str, str], platform_settings: PlatformSettings,
        tmp_path: Path) -> None:
    token = router_env["OPML_INFERENCE_ROUTER_WORKER_TOKEN"]
    share = thread_share(Fleet(FleetConfig.model_validate(FLEET)).kinds["cpu"])
    config = mlp_config("mlp", features=64, pool_kinds=("cpu",), precisions=("fp32",))
    model_dir = write_model_dir(tmp_path / "mlp", config, mlp_classifier(features=64, width=256, depth=2))
    router = start_service("inference-router", env=router_env)
    with DeploymentClient(router.target, token=TOKENS["writer"]) as writer, \
            DeploymentClient(router.target, token=TOKENS["reader"]) as reader:
        deployed = writer.deploy(model_dir=str(model_dir)).versions[0]
        assert sessions(deployed) == {(share, "all", "sequential")} == worker_sessions(deployed, token)
        assert {r.session.basis for r in deployed.replicas} == {
            "defaults: no serving-configuration measurements of models/mlp/versions/1 to predict cpu from"}

        writer.measure_serving_configs(VERSION, "cpu", GRID, runs=5, passes=1)  # returns once re-placed
        placed = reader.get("mlp").versions[0]
        chosen = expected_choice(reader, placed, ModelConfig.from_dict(config))
        assert sessions(placed) == {chosen} == worker_sessions(placed, token)
        basis = {r.session.basis for r in placed.replicas}
        assert len(basis) == 1 and "predicted best of" in basis.pop()
        assert all(r.session.threads <= share for r in placed.replicas)

    if chosen != (share, "all", "sequential"):  # a new configuration: the replica was re-loaded, announced
        records = asyncio.run(read_records(platform_settings, DEPLOYMENTS.full_name(platform_settings.topic_prefix),
                                           4))
        changes = [CloudEvent.from_kafka(r.headers, r.value) for r in records]
        last = [e.parse(events.PlacementChanged) for e in changes if e.type.endswith("PlacementChanged")][-1]
        assert any("models/mlp/versions/1: serving configuration" in reason for reason in last.reasons), last.reasons
        replicas = [r for w in last.placement.workers for r in w.replicas]
        assert {(r.session.threads, r.session.opt_level, r.session.execution_mode) for r in replicas} == {chosen}
    else:  # the defaults predicted best: the same replica, its reason renewed
        assert placed.replicas[0].session.basis.startswith("defaults ")  # predicted best, or kept within 5% of it

    # Restarted over the stored state (deployments, profiles, measurements in Redis): the same configuration.
    router.stop()
    again = start_service("inference-router", env=router_env)
    with DeploymentClient(again.target, token=TOKENS["reader"]) as reader:
        restored = reader.get("mlp").versions[0]
    assert restored.state == pb.SERVING
    assert sessions(restored) == {chosen} == worker_sessions(restored, token)
