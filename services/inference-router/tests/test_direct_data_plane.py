"""The direct data plane (opml_inference_router.data_plane) on a real router process, its native front
and a real worker: after a credential's first call, ModelInfer goes from the front straight to the
worker, answered as through the router, and every call still reaches the router's metrics, its
replicas' bookkeeping and the prediction log; what the direct path cannot finish goes through the router."""

from __future__ import annotations

import re
import subprocess
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import psutil
import pytest
import tritonclient.grpc as triton
import yaml
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from opml_devstack.process import ServiceProcess
from opml_devstack.testing.bus import poll_until
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_inference_router.testing import mlp_config, write_model_dir
from opml_inference_router_contract.client import DeploymentClient

FLEET = {
    "pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 2, "cost_per_hour": 0.4,
                    "execution_provider": "CPUExecutionProvider"}],
    "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}],
}
INFERENCE_TOKENS = {**TOKENS, "inference": "inference-token"}


@pytest.fixture
def router(start_service: ServiceStarter, tmp_path: Path) -> tuple[ServiceProcess, str]:
    """A router with the direct data plane serving model ``mlp``; its process and inference target."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(FLEET))
    env = start_service.env("inference-router", tokens=INFERENCE_TOKENS, extra_env={
        "OPML_INFERENCE_ROUTER_FLEET": str(fleet), "OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA": "1",
        "OPML_INFERENCE_ROUTER_DIRECT_DATA_PLANE": "true"})
    process = start_service("inference-router", env=env)
    model_dir = write_model_dir(tmp_path / "mlp", mlp_config("mlp", pool_kinds=("cpu",), precisions=("fp32",)))
    with DeploymentClient(process.target, token=TOKENS["writer"]) as client:
        client.deploy(model_dir=str(model_dir))
    return process, f"127.0.0.1:{env['OPML_INFERENCE_ROUTER_INFERENCE_PORT']}"


def _auth(role: str) -> dict[str, str]:
    return {"authorization": f"Bearer {INFERENCE_TOKENS.get(role, 'not-a-token')}"}


def _infer(target: str, data: np.ndarray, role: str = "inference", **options) -> np.ndarray:
    with triton.InferenceServerClient(target) as client:
        tensor = triton.InferInput("features", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        return client.infer("mlp", [tensor], headers=_auth(role), **options).as_numpy("scores")


def _direct(process: ServiceProcess, kind: str = "outcome") -> float:
    return _metric(process, "opml_inference_router_direct_reported_total").get((f"type={kind}",), 0.0)


def test_calls_after_the_first_go_straight_to_the_worker_and_are_all_counted_and_published(
        router: tuple[ServiceProcess, str], tmp_path: Path) -> None:
    process, target = router
    session = ort.InferenceSession(str(tmp_path / "mlp" / "model.onnx"))
    rng = np.random.default_rng(0)
    sent = 0

    def checked_call() -> None:
        nonlocal sent
        data = rng.standard_normal((2, 16)).astype(np.float32)
        np.testing.assert_allclose(_infer(target, data), session.run(None, {"features": data})[0], rtol=1e-5)
        sent += 1

    # the credential's first call goes through the router, which pushes its verdict; the front's calls
    # of the model make the router lease it admission tokens within an interval
    poll_until(lambda: checked_call() or _direct(process) >= 1, timeout_s=60, what="a call on the direct path")
    poll_until(lambda: _ok(process) == sent, timeout_s=30, what="every call counted")
    direct_before = _direct(process)
    calls = 20
    for _ in range(calls):
        checked_call()
    poll_until(lambda: _ok(process) == sent, timeout_s=30, what="every call counted")
    assert _direct(process) - direct_before == calls  # one at a time: a token is always left
    answered = _metric(process, "opml_inference_router_requests_total")
    assert answered[("code=OK", "model=mlp", "version=1")] == sent
    poll_until(lambda: _metric(process, "opml_inference_router_predictions_published_total")[()] == sent,
               timeout_s=60, what="every prediction published")
    assert _metric(process, "opml_inference_router_predictions_dropped_total").get(("reason=queue_full",), 0) == 0
    assert _metric(process, "opml_inference_router_direct_tokens")[("model=mlp",)] >= 1

    # a version named as the routed one goes direct too; one that is not served is the router's NOT_FOUND
    data = np.ones((1, 16), np.float32)
    np.testing.assert_allclose(_infer(target, data, model_version="1"), session.run(None, {"features": data})[0],
                               rtol=1e-5)
    poll_until(lambda: _direct(process) - direct_before == calls + 1, timeout_s=30,
               what="the named version's call reported")
    with pytest.raises(InferenceServerException) as missing:
        _infer(target, data, model_version="7")
    assert missing.value.status() == "StatusCode.NOT_FOUND"

    # a worker's refusal of a bad tensor is the caller's answer, as through the router
    with pytest.raises(InferenceServerException) as bad:
        _infer(target, np.zeros((1, 8), np.float32))
    assert bad.value.status() == "StatusCode.INVALID_ARGUMENT" and "features" in bad.value.message()
    poll_until(lambda: _metric(process, "opml_inference_router_front_requests_total").get(
        ("code=INVALID_ARGUMENT", "method=ModelInfer")) == 1, timeout_s=30, what="the refusal counted")

    # a credential the router let through once does not open the door to others
    with pytest.raises(InferenceServerException) as forged:
        _infer(target, data, role="forged")
    assert forged.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException) as reader:
        _infer(target, data, role="reader")
    assert reader.value.status() == "StatusCode.PERMISSION_DENIED"


def test_a_worker_killed_under_a_direct_call_is_ejected_and_the_router_answers_the_call(
        router: tuple[ServiceProcess, str]) -> None:
    process, target = router
    data = np.zeros((1, 16), np.float32)
    expected = _infer(target, data)
    poll_until(lambda: _infer(target, data) is None or _direct(process) >= 1, timeout_s=60, what="a direct call")
    worker = next(child for child in psutil.Process(process.process.pid).children(recursive=True)
                  if "opml_inference_router.worker" in " ".join(child.cmdline()))
    request = pb.ModelInferRequest(model_name="mlp", raw_input_contents=[data.tobytes()])
    request.inputs.add(name="features", datatype="FP32", shape=list(data.shape))
    worker.suspend()
    try:
        with grpc.insecure_channel(target) as channel:
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer").future(
                request.SerializeToString(), metadata=tuple(_auth("inference").items()), timeout=120)
            poll_until(lambda: _unread_bytes(worker.pid) > 0, timeout_s=60, what="the front's frame at the worker")
            worker.kill()
            answer = pb.ModelInferResponse.FromString(call.result(timeout=120))
    finally:
        if worker.is_running():
            worker.kill()
    np.testing.assert_array_equal(np.frombuffer(answer.raw_output_contents[0], np.float32).reshape(1, 4), expected)
    poll_until(lambda: _direct(process, "attempt_failed") == 1, timeout_s=30, what="the failed attempt reported")
    assert sum(_metric(process, "opml_inference_router_replica_ejections_total").values()) >= 1


def _ok(process: ServiceProcess) -> float:
    return _metric(process, "opml_inference_router_front_requests_total").get(("code=OK", "method=ModelInfer"), 0.0)


def _unread_bytes(pid: int) -> int:
    """Bytes waiting in the receive queues of process ``pid``'s Unix sockets (``ss``)."""
    listing = subprocess.run(["ss", "-xnp"], capture_output=True, text=True, check=True).stdout
    return sum(int(line.split()[2]) for line in listing.splitlines()[1:]
               if re.search(rf"pid={pid},", line) and line.split()[2].isdigit())


def _metric(process: ServiceProcess, name: str) -> dict[tuple[str, ...], float]:
    """The router's samples of ``name``, by their ``label=value`` pairs in label order."""
    port = process.env["OPML_INFERENCE_ROUTER_METRICS_PORT"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for match in re.finditer(rf"^{name}(?:\{{(.*?)\}})? (\S+)$", text, re.MULTILINE):
        labels = tuple(sorted(f"{k}={v}" for k, v in re.findall(r'(\w+)="([^"]*)"', match.group(1) or "")))
        samples[labels] = float(match.group(2))
    return samples
