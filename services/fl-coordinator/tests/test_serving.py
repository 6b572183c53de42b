"""Flow 3 end to end: each round's global model, committed to bundle-store as ONNX with its
model.yaml and the tag serve=true, is deployed by the inference-router by itself (from the bundles
topic), and the final one answers KServe v2 requests with what the federated weights compute."""

from __future__ import annotations

import threading

import numpy as np
import tritonclient.grpc as triton
import yaml
from member import DigitsMember
from opml.inference.v1 import deployments_pb2 as dpb

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import NotFound
from opml_devstack.testing.bus import poll_until
from opml_devstack.testing.services import TOKENS
from opml_fl_coordinator.simulator import SoftmaxModel, partition_digits
from opml_fl_coordinator_contract.client import FederationClient, run_client
from opml_inference_router_contract.client import DeploymentClient

ONE_CPU_WORKER = {
    "pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 2, "cost_per_hour": 0.4,
                    "execution_provider": "CPUExecutionProvider"}],
    "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}],
}


def test_the_federated_model_is_served_by_the_inference_router(start_service, tmp_path):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(ONE_CPU_WORKER))
    store = start_service("bundle-store")
    router = start_service("inference-router", extra_env={
        "OPML_INFERENCE_ROUTER_FLEET": str(fleet), "OPML_INFERENCE_ROUTER_BUNDLE_STORE_TARGET": store.target,
        "OPML_INFERENCE_ROUTER_BUNDLE_STORE_TOKEN": TOKENS["reader"],
        "OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA": "1"})
    coordinator = start_service("fl-coordinator", extra_env={
        "OPML_FL_COORDINATOR_BUNDLE_STORE_TARGET": store.target,
        "OPML_FL_COORDINATOR_BUNDLE_STORE_TOKEN": TOKENS["writer"], "OPML_FL_COORDINATOR_PUBLISH_EVERY_ROUND": "true"})
    # served by default: neither the service nor the federation says serve
    with FederationClient(coordinator.target, token=TOKENS["writer"]) as writer:
        writer.create("name: served\nrounds: 3\nmin_clients: 2\nselection: {clients_per_round: 2}\n"
                      "local: {epochs: 2, batch_size: 16, learning_rate: 0.2}\n")
        tokens = [writer.register_client("served", f"plant-{i}").token for i in range(2)]
        threads = [threading.Thread(target=run_client, args=(coordinator.target, "served", tokens[i],
                                                             DigitsMember(i, 2)),
                                    kwargs={"token": TOKENS["reader"], "wait_s": 2.0}) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        federation = writer.get("served")
        weights = writer.weights("served")
    uuid = federation.model_bundle.rpartition("@")[2]
    assert federation.model_bundle.startswith("federated/fl-served@")
    # every round's model is a bundle; each names the one it was trained from as its lineage input
    with BundleStoreClient(store.target, token=TOKENS["reader"]) as bundles:
        versions = sorted(bundles.list_bundles("federated", bundle_name="fl-served"), key=lambda b: int(b.tags["round"]))
    assert [b.tags["round"] for b in versions] == ["1", "2", "3"] and versions[-1].uuid == uuid
    assert [list(b.lineage.input_uuids) for b in versions] == [[], [versions[0].uuid], [versions[1].uuid]]
    with DeploymentClient(router.target, token=TOKENS["reader"]) as deployments:
        def final_round_serving() -> dpb.Deployment | None:
            try:
                deployment = deployments.get("fl-served")
            except NotFound:
                return None
            served = [v for v in deployment.versions if v.state == dpb.SERVING and v.bundle_uuid == uuid]
            return deployment if served else None
        deployment = poll_until(final_round_serving, timeout_s=180, what="the router serving the final round's bundle")
    assert deployment.name.endswith("fl-served")
    x = partition_digits(2).test[0][:8]
    with triton.InferenceServerClient(router.target) as client:
        tensor = triton.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        answer = client.infer("fl-served", [tensor], headers={"authorization": f"Bearer {TOKENS['admin']}"})
    np.testing.assert_allclose(answer.as_numpy("probabilities"), SoftmaxModel(64, 10)._probabilities(weights, x),
                               rtol=1e-4, atol=1e-6)
