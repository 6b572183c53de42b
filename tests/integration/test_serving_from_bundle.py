"""Flow 2's first half across services: a model bundle committed to the bundle-store with the tag
serve=true is deployed by the inference-router from the bundles topic and answers tritonclient.
Both services run as real processes on the real broker, S3 and Redis."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import onnxruntime as ort
import tritonclient.grpc as triton
from opml.inference.v1 import deployment_events_pb2 as events
from opml.inference.v1 import deployments_pb2 as pb

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.bus import CloudEvent
from opml_common.errors import NotFound
from opml_devstack.testing.bus import poll_until, read_records
from opml_devstack.testing.services import TOKENS
from opml_inference_router.testing.models import write_broken_onnx
from opml_inference_router_contract.client import DeploymentClient
from opml_inference_router_contract.topics import DEPLOYMENTS


def _serving(client: DeploymentClient, model: str, version: int) -> pb.Deployment | None:
    """The deployment of ``model`` once ``version`` serves, else None."""
    try:
        deployment = client.get(model)
    except NotFound:
        return None
    return deployment if any(v.version == version and v.state == pb.SERVING for v in deployment.versions) else None


def test_a_committed_bundle_tagged_serve_is_deployed_and_answers(serving_stack, platform_settings,
                                                                  tmp_path: Path) -> None:
    store_service, router, files = serving_stack.store, serving_stack.router, serving_stack.files
    with BundleStoreClient(store_service.target, token=TOKENS["writer"]) as store, \
            DeploymentClient(router.target, token=TOKENS["reader"]) as deployments:
        store.create_context("serving")
        store.add("serving", "mlp-notes", {"README": b"not a model"}, commit=True)  # no serve tag: ignored
        bundle = store.add("serving", "mlp", files, tags={"serve": "true"}, commit=True)

        deployment = poll_until(lambda: _serving(deployments, "mlp", 1), timeout_s=60, what="mlp v1 serving")
        served = deployment.versions[0]
        assert served.bundle.context == "serving" and served.bundle_uuid == bundle.uuid

        data = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
        expected = ort.InferenceSession(str(files["model.onnx"])).run(None, {"features": data})[0]
        with triton.InferenceServerClient(router.target) as client:
            tensor = triton.InferInput("features", list(data.shape), "FP32")
            tensor.set_data_from_numpy(data)
            result = client.infer("mlp", [tensor], headers={"authorization": f"Bearer {TOKENS['writer']}"})
        np.testing.assert_allclose(result.as_numpy("scores"), expected, rtol=1e-5)

        # A broken ONNX file in a bundle tagged for serving: DeployFailed with onnxruntime's reason; v1 serves on.
        broken = write_broken_onnx(tmp_path / "broken" / "model.onnx")
        store.add("serving", "mlp", {"model.onnx": broken, "model.yaml": files["model.yaml"]},
                  tags={"serve": "true", "version": "2"}, commit=True)
        topic = DEPLOYMENTS.full_name(platform_settings.topic_prefix)

        def deploy_failed() -> list[events.DeployFailed]:
            records = asyncio.run(read_records(platform_settings, topic, 1, timeout_s=10))
            received = [CloudEvent.from_kafka(r.headers, r.value) for r in records]
            return [e.parse(events.DeployFailed) for e in received if e.type.endswith("DeployFailed")]

        failed = poll_until(deploy_failed, timeout_s=60, every_s=0.5, what="DeployFailed of mlp v2")
        assert failed[0].model == "mlp" and failed[0].version == 2
        assert failed[0].code == "INVALID_ARGUMENT" and "NoSuchOperator" in failed[0].reason
        states = {v.version: v.state for v in deployments.get("mlp").versions}
        assert states == {1: pb.SERVING, 2: pb.FAILED}
        with triton.InferenceServerClient(router.target) as client:
            assert client.is_model_ready("mlp", headers={"authorization": f"Bearer {TOKENS['reader']}"})
