"""One model version on two pool kinds at once through a real router process (its real cpu and accel
workers, Redis, the broker): a config with ``instance_groups`` gets a replica of each group, its status
shows each replica's kind and precision, and requests to the version are answered by both (counted per
worker on the router's /metrics, which carries each worker's series with its ``pool_kind``)."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
from opml.inference.v1 import deployments_pb2 as pb
from prometheus_client.parser import text_string_to_metric_families

from opml_common.errors import InvalidArgument
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_inference_router.testing import fleet_env, mlp_config, write_model_dir
from opml_inference_router_contract.client import DeploymentClient

HEADERS = {"authorization": f"Bearer {TOKENS['writer']}"}
REQUESTS = 200


def served_per_kind(metrics_port: str) -> dict[str, float]:
    """Requests the version's replicas ran, per pool kind (the workers' inference-duration counts)."""
    page = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == "opml_inference_router_worker_inference_duration_seconds_count" and \
                    sample.labels.get("model") == "both":
                kind = sample.labels["pool_kind"]
                counts[kind] = counts.get(kind, 0.0) + sample.value
    return counts


def infer(target: str, index: int) -> None:
    tensor = triton.InferInput("features", [1, 16], "FP32")
    tensor.set_data_from_numpy(np.full((1, 16), index % 7, np.float32))
    with triton.InferenceServerClient(target) as client:
        client.infer("both", [tensor], request_id=f"r-{index}", client_timeout=30, headers=HEADERS)


def test_a_version_with_two_groups_serves_on_both_kinds(start_service: ServiceStarter, tmp_path: Path) -> None:
    env = start_service.env("inference-router", extra_env={
        **fleet_env(tmp_path / "fleet.yaml"), "OPML_INFERENCE_ROUTER_REPLAN_INTERVAL_S": "0"})
    config = mlp_config("both", pool_kinds=("accel", "cpu"), precisions=("int8", "fp32"))
    config["instance_groups"] = [{"pool_kind": "accel", "precision": "int8", "count": 1},
                                 {"pool_kind": "cpu", "precision": "fp32", "count": 1}]
    model_dir = write_model_dir(tmp_path / "both", config)
    router = start_service("inference-router", env=env)
    with DeploymentClient(router.target, token=TOKENS["writer"]) as writer:
        wrong = {**config, "name": "wrong", "instance_groups": [{"pool_kind": "accel", "precision": "fp32"},
                                                                {"pool_kind": "cpu", "precision": "fp32"}]}
        with pytest.raises(InvalidArgument) as refused:  # the fleet's accel kind runs int8 only
            writer.deploy(model_dir=str(write_model_dir(tmp_path / "wrong", wrong)))
        assert refused.value.field == "instance_groups[0].precision", refused.value
        deployed = writer.deploy(model_dir=str(model_dir)).versions[0]
    assert deployed.state == pb.SERVING, deployed.reason
    assert sorted((r.pool_kind, r.precision) for r in deployed.replicas) == [("accel", "int8"), ("cpu", "fp32")]
    assert len({r.worker for r in deployed.replicas}) == 2
    assert not deployed.reason  # not short
    assert deployed.planned_rate_rps == pytest.approx(config["expected_rate_rps"])  # the groups' shares together

    with ThreadPoolExecutor(8) as pool:  # concurrent, so both replicas hold requests at once
        list(pool.map(lambda index: infer(router.target, index), range(REQUESTS)))
    counts = served_per_kind(env["OPML_INFERENCE_ROUTER_METRICS_PORT"])
    assert set(counts) == {"accel", "cpu"} and all(count > 0 for count in counts.values()), counts
    # the profiler's requests count too: at least every request the test sent was run by one of them
    assert sum(counts.values()) >= REQUESTS, counts
