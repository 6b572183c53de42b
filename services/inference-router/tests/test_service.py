"""The inference-router service end to end: a real process with its real worker processes, real
tansu, SeaweedFS and Redis; tritonclient for inference, the DeploymentService client and CLI."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import onnxruntime as ort
import psutil
import pytest
import tritonclient.grpc as triton
import yaml
from click.testing import CliRunner
from opml.inference.v1 import deployment_events_pb2 as events
from opml.inference.v1 import deployments_pb2 as pb
from opml.inference.v1 import events_pb2
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from opml_common.bus import CloudEvent
from opml_common.cli import main as opml
from opml_common.config import PlatformSettings
from opml_common.errors import InvalidArgument, PermissionDenied
from opml_devstack.process import ServiceProcess
from opml_devstack.testing.bus import read_records
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_inference_router.testing import mlp_classifier, mlp_config, worker_processes, write_model_dir
from opml_inference_router_contract.client import DeploymentClient
from opml_inference_router_contract.topics import DEPLOYMENTS, PREDICTIONS

FLEET = {
    "pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 2, "cost_per_hour": 0.4,
                    "execution_provider": "CPUExecutionProvider"}],
    "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}],
}


@pytest.fixture
def router_env(start_service: ServiceStarter, tmp_path: Path) -> dict[str, str]:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(FLEET))
    return start_service.env("inference-router", extra_env={
        "OPML_INFERENCE_ROUTER_FLEET": str(fleet),
        "OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA": "1",
    })


@pytest.fixture
def router_service(start_service: ServiceStarter, router_env: dict[str, str]) -> ServiceProcess:
    return start_service("inference-router", env=router_env)


def _infer(target: str, data: np.ndarray) -> np.ndarray:
    with triton.InferenceServerClient(target) as client:
        tensor = triton.InferInput("features", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        result = client.infer("mlp", [tensor], request_id="req-1",
                              headers={"authorization": f"Bearer {TOKENS['writer']}"})
        return result.as_numpy("scores")


def test_deploy_infer_events_cli_and_restart(router_service: ServiceProcess, router_env: dict[str, str],
                                             start_service: ServiceStarter, platform_settings: PlatformSettings,
                                             tmp_path: Path) -> None:
    model_dir = write_model_dir(tmp_path / "mlp", mlp_config("mlp", pool_kinds=("cpu",), precisions=("fp32",)))
    target = router_service.target
    with DeploymentClient(target, token=TOKENS["writer"]) as client:
        deployment = client.deploy(model_dir=str(model_dir))
        assert deployment.name == "models/mlp" and deployment.versions[0].state == pb.SERVING
        assert deployment.versions[0].replicas[0].worker == "cpu-000"
        with pytest.raises(InvalidArgument) as caught:
            client.deploy()  # neither a bundle nor a directory
        assert caught.value.field == "source"
        with pytest.raises(PermissionDenied):
            client.undeploy("mlp")  # admin only

    data = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    expected = ort.InferenceSession(str(model_dir / "model.onnx")).run(None, {"features": data})[0]
    np.testing.assert_allclose(_infer(target, data), expected, rtol=1e-5)
    with pytest.raises(InferenceServerException) as bad:
        _infer(target, np.ascontiguousarray(data[:, :8]))  # the model takes 16 features
    assert "features" in str(bad.value) and "INVALID_ARGUMENT" in str(bad.value.status())

    prefix = platform_settings.topic_prefix
    predictions = asyncio.run(read_records(platform_settings, PREDICTIONS.full_name(prefix), 1))
    made = CloudEvent.from_kafka(predictions[0].headers, predictions[0].value).parse(events_pb2.PredictionMade)
    assert made.request_id == "req-1" and made.model_name == "mlp" and made.model_version == "1"
    response = service_pb2.ModelInferResponse.FromString(made.infer_response)
    np.testing.assert_allclose(np.frombuffer(response.raw_output_contents[0], np.float32).reshape(2, 4), expected,
                               rtol=1e-5)
    records = asyncio.run(read_records(platform_settings, DEPLOYMENTS.full_name(prefix), 3))
    types = [CloudEvent.from_kafka(r.headers, r.value).type for r in records]
    assert {"opml.inference.v1.PlacementChanged", "opml.inference.v1.TrafficChanged",
            "opml.inference.v1.ModelDeployed"} <= set(types)
    deployed = next(CloudEvent.from_kafka(r.headers, r.value) for r in records
                    if CloudEvent.from_kafka(r.headers, r.value).type.endswith("ModelDeployed"))
    assert deployed.subject == "mlp" and deployed.parse(events.ModelDeployed).deployment.stable_version == 1

    runner = CliRunner()
    cli = ["model", "--target", target, "--token", TOKENS["reader"]]
    listed = runner.invoke(opml, [*cli, "ls"])
    assert listed.exit_code == 0 and "mlp" in listed.output and "SERVING" in listed.output, listed.output
    placed = runner.invoke(opml, [*cli, "placement", "--json"])
    assert placed.exit_code == 0 and '"usedSlots": 1' in placed.output, placed.output
    denied = runner.invoke(opml, [*cli, "traffic", "mlp", "v1=1"])
    assert denied.exit_code == 1 and "PERMISSION_DENIED" in denied.output

    v2 = write_model_dir(tmp_path / "mlp-2", mlp_config("mlp", pool_kinds=("cpu",), precisions=("fp32",)),
                         mlp_classifier(seed=5))
    writer = ["model", "--target", target, "--token", TOKENS["writer"]]
    canary = runner.invoke(opml, [*writer, "deploy", "--dir", str(v2), "--canary", "30"])
    assert canary.exit_code == 0 and "v2" in canary.output and "30%" in canary.output, canary.output

    # A stopped router stops its workers (they run in sessions of their own, so nothing else would).
    workers = worker_processes(router_service.process.pid)
    assert len(workers) == 1  # the test fleet's one cpu worker
    router_service.stop()
    assert not [w.pid for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]

    # A restarted router rebuilds its deployments from Redis onto fresh workers, the split included.
    with start_service("inference-router", env=router_env):
        with DeploymentClient(target, token=TOKENS["reader"]) as client:
            restored = client.get("mlp")
        assert restored.stable_version == 1
        assert {v.version: (v.state, round(v.traffic_percent)) for v in restored.versions} == {
            1: (pb.SERVING, 70), 2: (pb.SERVING, 30)}
        rolled = runner.invoke(opml, [*writer, "rollback", "mlp"])
        assert rolled.exit_code == 0, rolled.output
        np.testing.assert_allclose(_infer(target, data), expected, rtol=1e-5)  # v1 answers all again
        admin = ["model", "--target", target, "--token", TOKENS["admin"]]
        shown = runner.invoke(opml, [*admin, "get", "mlp", "--json"])
        assert shown.exit_code == 0 and '"state": "SERVING"' in shown.output, shown.output
        assert '"version": "2"' not in shown.output
        gone = runner.invoke(opml, [*admin, "undeploy", "mlp"])
        assert gone.exit_code == 0, gone.output
        assert "mlp" not in runner.invoke(opml, [*admin, "ls"]).output
