"""The router's native inference front (native/front.cc) on a real router process with a real worker:
the same answers as the router's Python gRPC port, the router's auth, errors with their codes, and
its lifetime (restarted when it dies, gone when the router dies)."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import psutil
import pytest
import tritonclient.grpc as triton
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from opml_common.errors import FailedPrecondition
from opml_common.metrics import ServiceMetrics
from opml_devstack.process import ServiceProcess
from opml_devstack.testing.bus import poll_until
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_inference_router.frontend import InferenceFrontend
from opml_inference_router.native_front import FrontLink, NativeFront
from opml_inference_router.routing import Router
from opml_inference_router.testing import front_process, mlp_config, write_model_dir
from opml_inference_router_contract.client import DeploymentClient

FLEET = {
    "pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 2, "cost_per_hour": 0.4,
                    "execution_provider": "CPUExecutionProvider"}],
    "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}],
}
INFERENCE_TOKENS = {**TOKENS, "inference": "inference-token"}


@pytest.fixture
def router(start_service: ServiceStarter, tmp_path: Path) -> tuple[ServiceProcess, str]:
    """A router serving model ``mlp`` (deployed from a directory); its process and inference target."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(FLEET))
    env = start_service.env("inference-router", tokens=INFERENCE_TOKENS, extra_env={
        "OPML_INFERENCE_ROUTER_FLEET": str(fleet), "OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA": "1"})
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


def _wait_serving(target: str) -> None:
    """Until the front at ``target`` takes calls again (a restarted one binds its port again)."""
    with grpc.insecure_channel(target) as channel:
        grpc.channel_ready_future(channel).result(timeout=60)


def test_inference_port_answers_as_the_router_does(router: tuple[ServiceProcess, str], tmp_path: Path) -> None:
    process, target = router
    data = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    expected = ort.InferenceSession(str(tmp_path / "mlp" / "model.onnx")).run(None, {"features": data})[0]
    np.testing.assert_allclose(_infer(target, data), expected, rtol=1e-5)
    np.testing.assert_allclose(_infer(process.target, data), _infer(target, data), rtol=0)

    with triton.InferenceServerClient(target) as client:
        headers = _auth("reader")
        assert client.is_server_live(headers=headers) and client.is_server_ready(headers=headers)
        assert client.is_model_ready("mlp", headers=headers) and not client.is_model_ready("nope", headers=headers)
        assert client.get_server_metadata(headers=headers).name == "opml-inference-router"
        metadata = client.get_model_metadata("mlp", headers=headers)
        assert metadata.versions == ["1"] and metadata.inputs[0].name == "features"
        with pytest.raises(InferenceServerException) as missing:
            client.get_model_metadata("nope", headers=headers)
        assert missing.value.status() == "StatusCode.NOT_FOUND"

    with pytest.raises(InferenceServerException) as bad:
        _infer(target, np.ascontiguousarray(data[:, :8]))  # the model takes 16 features
    assert bad.value.status() == "StatusCode.INVALID_ARGUMENT" and "features" in bad.value.message()

    with grpc.insecure_channel(target) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as malformed:
            infer(b"\xff\xff\xff", metadata=tuple(_auth("inference").items()))
        assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert malformed.value.details().startswith("request")
        for method in ("ModelMetadata", "ModelReady", "ServerLive"):  # decoded by the router: the same refusal
            with pytest.raises(grpc.RpcError) as undecodable:
                channel.unary_unary(f"/inference.GRPCInferenceService/{method}")(
                    b"\xff\xff\xff", metadata=tuple(_auth("inference").items()), timeout=30)
            assert undecodable.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert undecodable.value.details().startswith(f"request: must be an inference.{method}Request")
        listing = channel.unary_unary("/opml.inference.v1.DeploymentService/ListDeployments")
        with pytest.raises(grpc.RpcError) as elsewhere:
            listing(b"")
        assert elsewhere.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert f"on port {process.env['OPML_INFERENCE_ROUTER_GRPC_PORT']}" in elsewhere.value.details()
    with pytest.raises(InferenceServerException) as late:  # a valid request: whoever sees the deadline first
        _infer(target, data, client_timeout=-1)  # passed: gRPC rounds a deadline up to the next ms, and
        # an idle replica's answer on the direct path came within 1 us + that
    assert late.value.status() == "StatusCode.DEADLINE_EXCEEDED"

    counted = _metric(process, "opml_inference_router_front_requests_total")
    # the late call is counted by how the front saw it end: the router may answer it at once (an idle
    # replica runs it without waiting its queue delay) before the front notices the client's deadline
    assert counted[("code=OK", "method=ModelInfer")] in (2, 3), counted
    assert counted[("code=NOT_FOUND", "method=ModelMetadata")] == 1
    assert counted[("code=INVALID_ARGUMENT", "method=ModelInfer")] == 2


def test_the_router_checks_every_call_on_the_inference_port(router: tuple[ServiceProcess, str]) -> None:
    _process, target = router
    data = np.zeros((1, 16), np.float32)
    with triton.InferenceServerClient(target) as client:
        with pytest.raises(InferenceServerException) as anonymous:
            client.is_server_live()
        assert anonymous.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException) as forged:
        _infer(target, data, role="forged")
    assert forged.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException) as reader:
        _infer(target, data, role="reader")
    assert reader.value.status() == "StatusCode.PERMISSION_DENIED"
    assert "ModelInfer needs the inference role" in reader.value.message()
    assert _infer(target, data, role="inference").shape == (1, 4)



def test_a_call_its_caller_cancels_is_cancelled_at_the_router(router: tuple[ServiceProcess, str]) -> None:
    """The caller goes away while its call waits on a (stopped) worker: the front tells the router,
    which stops waiting for the worker (the replica's outstanding count falls back) and counts it."""
    process, target = router
    worker = next(child for child in psutil.Process(process.process.pid).children(recursive=True)
                  if "opml_inference_router.worker" in " ".join(child.cmdline()))
    data = np.zeros((1, 16), np.float32)
    request = pb.ModelInferRequest(model_name="mlp", raw_input_contents=[data.tobytes()])
    request.inputs.add(name="features", datatype="FP32", shape=list(data.shape))
    worker.suspend()
    try:
        with grpc.insecure_channel(target) as channel:
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer").future(
                request.SerializeToString(), metadata=tuple(_auth("inference").items()), timeout=120)
            poll_until(lambda: _outstanding(process) == 1, timeout_s=60, what="the call waiting on the worker")
            call.cancel()
            poll_until(lambda: _metric(process, "opml_inference_router_front_requests_total").get(
                ("code=CANCELLED", "method=ModelInfer")) == 1, timeout_s=60, what="the router counting it cancelled")
            poll_until(lambda: _outstanding(process) == 0, timeout_s=60, what="the worker call dropped")
    finally:
        worker.resume()
    # the resumed worker serves again; its first answer may take longer than the model's 200 ms default
    # deadline on a loaded machine, so the call carries its own
    assert _infer(target, data, client_timeout=30).shape == (1, 4)


def test_a_killed_front_comes_back_on_its_port_and_a_killed_router_takes_it_along(
        router: tuple[ServiceProcess, str]) -> None:
    process, target = router
    data = np.ones((2, 16), np.float32)
    before = _infer(target, data)
    first = front_process(process.process.pid)
    assert not [key for key in first.environ() if key.startswith("OPML_")]  # no token, no S3 or broker secret
    first.kill()
    first.wait(timeout=30)
    _wait_serving(target)
    second = front_process(process.process.pid)
    assert second.pid != first.pid
    np.testing.assert_array_equal(_infer(target, data), before)
    assert _metric(process, "opml_inference_router_front_restarts_total")[()] == 1

    process.kill()  # SIGKILL: the link's end closes with the router, and the front exits by itself
    second.wait(timeout=30)
    assert not second.is_running() or second.status() == psutil.STATUS_ZOMBIE


def _outstanding(process: ServiceProcess) -> float:
    return sum(_metric(process, "opml_inference_router_replica_outstanding_requests").values())


def _metric(process: ServiceProcess, name: str) -> dict[tuple[str, ...], float]:
    """The router's samples of counter ``name``, by their ``label=value`` pairs in label order."""
    port = process.env["OPML_INFERENCE_ROUTER_METRICS_PORT"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for match in re.finditer(rf"^{name}(?:\{{(.*?)\}})? (\S+)$", text, re.MULTILINE):
        labels = tuple(sorted(f"{k}={v}" for k, v in re.findall(r'(\w+)="([^"]*)"', match.group(1) or "")))
        samples[labels] = float(match.group(2))
    return samples


def _unlinked_front(port: int, **binary: Path) -> NativeFront:
    """A front whose router has no deployments: enough to see it start or fail to."""
    metrics = ServiceMetrics("inference-router", registry=CollectorRegistry())
    link = FrontLink(InferenceFrontend(Router(connect=lambda address: None, metrics=metrics)), tokens={},
                     metrics=metrics)
    return NativeFront(link, host="127.0.0.1", port=port, max_receive_bytes=1 << 20, grace_s=1.0, tls=None,
                       control_hint="", metrics=metrics, **binary)


async def test_a_front_that_cannot_start_says_why(tmp_path: Path) -> None:
    """A missing binary and a taken port stop the router's start with the reason, not a hang."""

    with pytest.raises(FailedPrecondition, match="is missing \\(run `make install`"):
        await _unlinked_front(0, binary=tmp_path / "opml-inference-front").start()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(FailedPrecondition, match=r"did not start on 127\.0\.0\.1:\d+ \(exit code 1;"):
            await _unlinked_front(taken.getsockname()[1]).start()



async def test_a_front_that_exits_by_itself_is_reported_with_its_own_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """asyncio's child watcher reaps the front late, as on a loaded machine: the router must not reap it
    first (``Process.kill`` polls), or the watcher finds no child and reports exit code 255."""
    real_waitpid = os.waitpid

    def late_waitpid(pid: int, options: int) -> tuple[int, int]:
        if options == 0:  # the watcher's blocking wait
            _once_exited_and_reaped_or_after(pid, grace_s=2.0)
        return real_waitpid(pid, options)

    monkeypatch.setattr(os, "waitpid", late_waitpid)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(FailedPrecondition, match=r"\(exit code 1;"):
            await _unlinked_front(taken.getsockname()[1]).start()


async def test_the_front_answers_health_itself() -> None:
    """grpc.health.v1.Health/Check on the front's own queue thread: service "" SERVING, any other
    unknown (as gRPC's default service), a malformed request refused; and none of the gRPC callback
    threads ("nexting") that gRPC's default health service brings into the process."""
    front = _unlinked_front(0)
    await front.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{front.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=30)
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
            assert unknown.value.details().startswith("unknown service nope;")
            with pytest.raises(grpc.aio.AioRpcError) as malformed:
                await channel.unary_unary("/grpc.health.v1.Health/Check")(b"\xff\xff\xff", timeout=30)
            assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        tasks = Path(f"/proc/{front_process(os.getpid()).pid}/task")
        threads = [(task / "comm").read_text().strip() for task in tasks.iterdir()]
        assert "nexting_thread" not in threads, threads
    finally:
        await front.stop()


async def test_a_health_watch_sees_the_front_stop() -> None:
    """Watch: the status first (SERVICE_UNKNOWN for an unknown service, its stream left open), then
    NOT_SERVING when the front stops (SIGTERM), and both streams end OK: they do not hold the graceful
    shutdown until its grace period ends (the server would cancel them then)."""
    front = _unlinked_front(0)
    await front.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{front.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            served = health.Watch(health_pb2.HealthCheckRequest(), timeout=120)
            unknown = health.Watch(health_pb2.HealthCheckRequest(service="nope"), timeout=120)
            assert (await served.read()).status == health_pb2.HealthCheckResponse.SERVING
            assert (await unknown.read()).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            stopping = asyncio.create_task(front.stop())
            assert (await served.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await served.read() is grpc.aio.EOF and await served.code() == grpc.StatusCode.OK
            assert await unknown.read() is grpc.aio.EOF and await unknown.code() == grpc.StatusCode.OK
            await stopping
    finally:
        await front.stop()


def _once_exited_and_reaped_or_after(pid: int, grace_s: float) -> None:
    """Returns when child ``pid`` has exited and then either someone reaped it or ``grace_s`` passed."""
    exited_at = None
    while True:
        try:
            zombie = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return
        if zombie:
            exited_at = exited_at or time.monotonic()
            if time.monotonic() - exited_at >= grace_s:
                return
        time.sleep(0.01)
