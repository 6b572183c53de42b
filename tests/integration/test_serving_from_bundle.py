"""Flow 2's first half across services: a model bundle committed to the bundle-store with the tag
serve=true is deployed by the inference-router from the bundles topic and answers tritonclient;
one whose model names external data outside its own folder is refused, naming the tensor and the path.
Both services run as real processes on the real broker, S3 and Redis."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as triton
import yaml
from opml.inference.v1 import deployment_events_pb2 as events
from opml.inference.v1 import deployments_pb2 as pb

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.bus import CloudEvent
from opml_common.errors import NotFound
from opml_devstack.testing.bus import poll_until, read_records
from opml_devstack.testing.services import TOKENS
from opml_inference_router.testing import external_weights_model, mlp_config
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


def _deploy_failed(platform_settings) -> list[events.DeployFailed]:
    """Every DeployFailed the router has published so far."""
    records = asyncio.run(read_records(platform_settings, DEPLOYMENTS.full_name(platform_settings.topic_prefix), 1,
                                       timeout_s=10))
    received = [CloudEvent.from_kafka(r.headers, r.value) for r in records]
    return [e.parse(events.DeployFailed) for e in received if e.type.endswith("DeployFailed")]


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
        failed = poll_until(lambda: _deploy_failed(platform_settings), timeout_s=60, every_s=0.5,
                            what="DeployFailed of mlp v2")
        assert failed[0].model == "mlp" and failed[0].version == 2
        assert failed[0].code == "INVALID_ARGUMENT" and "NoSuchOperator" in failed[0].reason
        states = {v.version: v.state for v in deployments.get("mlp").versions}
        assert states == {1: pb.SERVING, 2: pb.FAILED}
        with triton.InferenceServerClient(router.target) as client:
            assert client.is_model_ready("mlp", headers={"authorization": f"Bearer {TOKENS['reader']}"})


def test_a_bundle_whose_model_names_external_data_outside_its_folder_is_refused(serving_stack, platform_settings,
                                                                                tmp_path: Path) -> None:
    """A writer's serve=true bundle whose model keeps its weights in the router's ``s3.json``, an absolute
    path or a ``..`` path: DeployFailed naming the tensor and the path, nothing serves (so no inference
    and no prediction event can carry the file's bytes); weights beside the model serve."""
    secret = tmp_path / "sec" / "ext_secret.txt"
    secret.parent.mkdir()
    secret.write_bytes(b"secretKey=" * 30)
    refused = {"s3.json": ", which is not a file in the model's folder",
               str(secret): " by an absolute path; it must lie inside the model's folder",
               "../sec/ext_secret.txt": " outside the model's folder"}
    weights = np.arange(64, dtype=np.float32).reshape(16, 4)
    headers = {"authorization": f"Bearer {TOKENS['writer']}"}

    def files(name: str, location: str) -> dict[str, bytes]:
        config = mlp_config(name, pool_kinds=("cpu",), precisions=("fp32",))
        return {"model.yaml": yaml.safe_dump(config).encode(),
                "model.onnx": external_weights_model(location).SerializeToString()}

    with BundleStoreClient(serving_stack.store.target, token=TOKENS["writer"]) as store, \
            DeploymentClient(serving_stack.router.target, token=TOKENS["reader"]) as deployments, \
            triton.InferenceServerClient(serving_stack.router.target) as client:
        store.create_context("serving")
        uuids = {store.add("serving", f"leak{index}", files(f"leak{index}", location), tags={"serve": "true"},
                           commit=True).uuid: location for index, location in enumerate(refused)}
        store.add("serving", "ext", {**files("ext", "weights.bin"), "weights.bin": weights.tobytes()},
                  tags={"serve": "true"}, commit=True)

        poll_until(lambda: _serving(deployments, "ext", 1), timeout_s=60, what="ext v1 serving")
        tensor = triton.InferInput("features", [16, 16], "FP32")
        tensor.set_data_from_numpy(np.eye(16, dtype=np.float32))
        np.testing.assert_array_equal(client.infer("ext", [tensor], headers=headers).as_numpy("scores"), weights)

        def every_refusal() -> dict[str, events.DeployFailed] | None:
            found = {e.bundle.bundle: e for e in _deploy_failed(platform_settings) if e.bundle.bundle in uuids}
            return found if len(found) == len(uuids) else None

        failed = poll_until(every_refusal, timeout_s=60, every_s=0.5, what="DeployFailed of the three bundles")
        for uuid, location in uuids.items():
            assert failed[uuid].code == "INVALID_ARGUMENT"
            assert failed[uuid].reason == f"model.onnx: tensor 'W1' names external data {location!r}{refused[location]}"
        for index in range(len(refused)):
            with pytest.raises(NotFound):
                deployments.get(f"leak{index}")
            assert not client.is_model_ready(f"leak{index}", headers=headers)
