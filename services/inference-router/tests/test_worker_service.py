"""Real worker processes driven through tritonclient's KServe v2 gRPC client, as existing clients are,
and through the Unix socket a router on the same machine uses."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import psutil
import pytest
import tritonclient.grpc as triton
import yaml
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from opml_common.errors import InvalidArgument
from opml_common.metrics import ServiceMetrics
from opml_inference_router.frames import KINDS, OK, REPORT, REQUEST, RESPONSE, FrameServerConnection
from opml_inference_router.kserve import encode_request
from opml_inference_router.routing.errors import ReplicaFailed
from opml_inference_router.routing.uds_replica import UdsReplica
from opml_inference_router.testing import mlp_classifier, mlp_config, write_broken_onnx, write_model_dir
from opml_inference_router.worker import WorkerProcess
from opml_inference_router.worker.uds import UdsServer

FLEET = {
    "pool_kinds": [
        {"name": "cpu", "precisions": ["fp32"], "memory_mib": 4096, "slots": 4, "cost_per_hour": 1.6,
         "execution_provider": "CPUExecutionProvider"},
        # An FPGA-style kind emulated on the CPU provider: int8 only, fixed batch shapes, two slots.
        {"name": "accel", "precisions": ["int8"], "memory_mib": 512, "slots": 2, "cost_per_hour": 1.0,
         "execution_provider": "CPUExecutionProvider", "batch_sizes": [1, 4, 8]},
    ],
    "pools": [{"name": "cpu-a", "kind": "cpu", "workers": 1}, {"name": "accel-a", "kind": "accel", "workers": 1}],
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("worker")
    (root / "fleet.yaml").write_text(yaml.safe_dump(FLEET))
    models = root / "models"
    write_model_dir(models / "mlp", mlp_config("mlp", max_queue_delay_us=5000), mlp_classifier(width=64, seed=1))
    slow = mlp_config("slow", max_queue_delay_us=300_000)
    slow["dynamic_batching"]["wait_when_idle"] = True  # even the first request waits: all sit queued
    write_model_dir(models / "slow", slow)
    write_model_dir(models / "broken", mlp_config("broken"))
    write_broken_onnx(models / "broken" / "model.onnx")
    for name in ("q1", "q2", "q3"):
        write_model_dir(models / name, mlp_config(name, classes=10), mlp_classifier(width=128, depth=3, classes=10))
    return root


def start_worker(root: Path, kind: str, name: str = "") -> WorkerProcess:
    """A worker of ``kind`` that also serves a local router on the Unix socket ``<root>/<name>.sock``."""
    name = name or kind
    return WorkerProcess(kind, root / "fleet.yaml", root / f"{name}.log", models_dir=root / "models",
                         env={"OPML_LOG_FORMAT": "text"}, uds=root / f"{name}.sock").start()


@pytest.fixture(scope="module")
def cpu_worker(root: Path) -> Iterator[WorkerProcess]:
    worker = start_worker(root, "cpu")
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def accel_worker(root: Path) -> Iterator[WorkerProcess]:
    worker = start_worker(root, "accel")
    try:
        yield worker
    finally:
        worker.stop()


def load(worker: WorkerProcess, name: str, **parameters: object) -> None:
    """RepositoryModelLoad with our parameters (tritonclient's load_model only sends config and files)."""
    request = pb.RepositoryModelLoadRequest(model_name=name)
    for key, value in parameters.items():
        field = {bool: "bool_param", int: "int64_param", str: "string_param"}[type(value)]
        setattr(request.parameters[key], field, value)
    with grpc.insecure_channel(worker.target) as channel:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).RepositoryModelLoad(request, timeout=30)


def features(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 16)).astype(np.float32)


def infer(client: triton.InferenceServerClient, model: str, data: np.ndarray, *, name: str = "features",
          datatype: str = "FP32", version: str = "") -> np.ndarray:
    tensor = triton.InferInput(name, list(data.shape), datatype)
    tensor.set_data_from_numpy(data)
    return client.infer(model, [tensor], model_version=version).as_numpy("scores")


def reference(root: Path, model: str, data: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(root / "models" / model / "model.onnx"))
    return session.run(None, {"features": data})[0]


def refused(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value.status(), caught.value.message()


def test_serves_kserve_v2_like_onnxruntime(cpu_worker: WorkerProcess, root: Path) -> None:
    client = triton.InferenceServerClient(cpu_worker.target)
    assert client.is_server_live() and client.is_server_ready()
    assert "model_repository" in client.get_server_metadata().extensions
    assert not client.is_model_ready("mlp")
    load(cpu_worker, "mlp", profile=True)
    assert client.is_model_ready("mlp") and client.is_model_ready("mlp", "1")
    metadata = client.get_model_metadata("mlp")
    assert (metadata.platform, list(metadata.versions)) == ("onnxruntime_onnx", ["1"])
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [("features", "FP32", [-1, 16])]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [("scores", "FP32", [-1, 4])]
    data = features(5)
    np.testing.assert_allclose(infer(client, "mlp", data), reference(root, "mlp", data), rtol=1e-5, atol=1e-6)

    config = client.get_model_config("mlp").config
    assert (config.max_batch_size, config.dynamic_batching.max_queue_delay_microseconds) == (32, 5000)
    profile = json.loads(config.parameters["opml_profile"].string_value)
    assert (profile["pool_kind"], profile["precision"]) == ("cpu", "fp32")
    assert sorted(map(int, profile["batch_latency_ms"])) == [1, 2, 4, 8, 16, 32]
    assert profile["memory_mib"] > 0
    assert [entry.name for entry in client.get_model_repository_index().models] == ["mlp"]


def test_bad_requests_name_what_is_wrong(cpu_worker: WorkerProcess) -> None:
    client = triton.InferenceServerClient(cpu_worker.target)
    load(cpu_worker, "mlp")
    data = features(2)
    assert refused(lambda: infer(client, "mlp", data, name="image")) == (
        "StatusCode.INVALID_ARGUMENT",
        "inputs[image]: is not an input of model mlp; its inputs are features (FP32 [-1,16])")
    assert refused(lambda: infer(client, "mlp", data.astype(np.float64), datatype="FP64")) == (
        "StatusCode.INVALID_ARGUMENT", "inputs[features]: expected FP32 [-1,16], got FP64 [2,16]")
    assert refused(lambda: infer(client, "mlp", features(2)[:, :8])) == (
        "StatusCode.INVALID_ARGUMENT", "inputs[features]: expected FP32 [-1,16], got FP32 [2,8]")
    assert refused(lambda: infer(client, "mlp", features(33))) == (
        "StatusCode.INVALID_ARGUMENT", "inputs[features]: batch size must be <= 32 (max_batch_size), but got 33")
    status, message = refused(lambda: infer(client, "nope", data))
    assert (status, message) == ("StatusCode.NOT_FOUND", "model 'nope' is not loaded on this worker (loaded: mlp)")
    status, message = refused(lambda: infer(client, "mlp", data, version="7"))
    assert (status, message) == ("StatusCode.NOT_FOUND",
                                 "version 7 of model 'mlp' is not loaded on this worker (loaded versions: 1)")
    assert refused(lambda: client.get_model_metadata("nope"))[0] == "StatusCode.NOT_FOUND"
    with pytest.raises(grpc.RpcError) as caught:
        load(cpu_worker, "mlp", replicas=2)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("parameters[replicas]: is not a parameter; use path, version")
    assert not client.is_model_ready("mlp", "7")


def test_broken_onnx_fails_its_load_and_other_models_keep_serving(cpu_worker: WorkerProcess, root: Path) -> None:
    client = triton.InferenceServerClient(cpu_worker.target)
    load(cpu_worker, "mlp")
    with pytest.raises(grpc.RpcError) as caught:
        load(cpu_worker, "broken")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "onnxruntime cannot load it" in caught.value.details()
    assert "NoSuchOperator" in caught.value.details()
    index = {entry.name: entry for entry in client.get_model_repository_index().models}
    assert index["broken"].state == "UNAVAILABLE" and "NoSuchOperator" in index["broken"].reason
    data = features(3, seed=4)
    np.testing.assert_allclose(infer(client, "mlp", data), reference(root, "mlp", data), rtol=1e-5, atol=1e-6)


def test_dynamic_batching_forms_batches_under_concurrency(cpu_worker: WorkerProcess, root: Path) -> None:
    client = triton.InferenceServerClient(cpu_worker.target)
    load(cpu_worker, "mlp")  # a reload: fresh statistics
    data = features(64, seed=9)
    with ThreadPoolExecutor(max_workers=16) as pool:
        replies = list(pool.map(lambda i: infer(client, "mlp", data[i:i + 1]), range(64)))
    np.testing.assert_allclose(np.concatenate(replies), reference(root, "mlp", data), rtol=1e-5, atol=1e-6)
    stats = client.get_inference_statistics("mlp").model_stats[0]
    assert stats.inference_count == 64
    assert stats.execution_count < 64, stats
    assert max(batch.batch_size for batch in stats.batch_stats) > 1
    assert sum(b.batch_size * b.compute_infer.count for b in stats.batch_stats) == 64
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{cpu_worker.metrics_port}/metrics", timeout=5).read().decode()
    assert 'opml_inference_router_worker_batch_size_bucket{le="1.0",model="mlp",version="1"}' in metrics
    assert "opml_inference_router_worker_inference_duration_seconds_count" in metrics
    assert 'opml_inference_router_worker_queue_depth{model="mlp",version="1"} 0.0' in metrics


def test_tritonclient_ships_a_bundle_and_unloads_it(cpu_worker: WorkerProcess) -> None:
    client = triton.InferenceServerClient(cpu_worker.target)
    model = mlp_classifier(seed=11)
    client.load_model("shipped", config=json.dumps(mlp_config("shipped")),
                      files={"file:2/model.onnx": model.SerializeToString()})
    assert client.is_model_ready("shipped", "2")
    data = features(4)
    expected = ort.InferenceSession(model.SerializeToString()).run(None, {"features": data})[0]
    np.testing.assert_allclose(infer(client, "shipped", data), expected, rtol=1e-5, atol=1e-6)
    client.unload_model("shipped")
    assert not client.is_model_ready("shipped")
    assert refused(lambda: client.unload_model("shipped"))[0] == "StatusCode.NOT_FOUND"


def test_accel_runs_int8_on_fixed_shapes_within_its_slots(accel_worker: WorkerProcess, root: Path) -> None:
    client = triton.InferenceServerClient(accel_worker.target)
    load(accel_worker, "q1", profile=True)
    config = client.get_model_config("q1").config
    assert config.parameters["opml_precision"].string_value == "int8"
    assert (config.max_batch_size, list(config.dynamic_batching.preferred_batch_size)) == (8, [1, 4, 8])
    profile = json.loads(config.parameters["opml_profile"].string_value)
    assert sorted(map(int, profile["batch_latency_ms"])) == [1, 4, 8]
    data = np.random.default_rng(5).standard_normal((60, 16)).astype(np.float32)
    quantized = np.concatenate([infer(client, "q1", data[i:i + 3]) for i in range(0, 60, 3)])  # 3 rows pad to 4
    expected = reference(root, "q1", data)
    assert quantized.shape == expected.shape
    assert np.mean(quantized.argmax(1) == expected.argmax(1)) >= 0.9
    assert np.max(np.abs(quantized - expected)) < 0.1
    load(accel_worker, "q2")
    with pytest.raises(grpc.RpcError) as caught:
        load(accel_worker, "q3")
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "has 0 free of 2 (in use by q1 v1, q2 v1)" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        load(accel_worker, "mlp", precision="fp32")
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_sigterm_lets_queued_requests_finish(root: Path) -> None:
    worker = start_worker(root, "cpu", "stopping")
    try:
        load(worker, "slow")  # batches wait up to 300 ms to fill: requests sit queued when SIGTERM comes
        client = triton.InferenceServerClient(worker.target)
        local = UdsReplica(worker.uds_target)

        async def over_uds() -> list[bytes]:  # a local router's calls, queued in the same batch
            try:
                return await asyncio.gather(*(local.call("ModelInfer", _request("slow", seed=i), timeout_s=10)
                                              for i in range(2)))
            finally:
                await local.close()

        with ThreadPoolExecutor(max_workers=5) as pool:
            pending = [pool.submit(infer, client, "slow", features(1, seed=i)) for i in range(4)]
            local_pending = pool.submit(asyncio.run, over_uds())
            time.sleep(0.1)
            worker.process.send_signal(signal.SIGTERM)
            replies = [future.result(timeout=10) for future in pending]
            local_replies = [pb.ModelInferResponse.FromString(reply) for reply in local_pending.result(timeout=10)]
        assert all(reply.shape == (1, 4) for reply in replies)
        assert [reply.model_name for reply in local_replies] == ["slow", "slow"]
        assert worker.process.wait(timeout=15) == 0
        assert not (root / "stopping.sock").exists()
    finally:
        worker.kill()


def test_a_worker_whose_router_is_killed_stops(root: Path) -> None:
    # The "router" here is a process that starts a worker the way the pool manager does, then dies by SIGKILL.
    starter = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from opml_inference_router.worker.process import WorkerProcess; "
         f"w = WorkerProcess('cpu', Path({str(root / 'fleet.yaml')!r}), Path({str(root / 'orphan.log')!r})).start(); "
         "print(w.process.pid, flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        worker = psutil.Process(int(starter.stdout.readline()))
        starter.kill()
        starter.wait()
        worker.wait(timeout=15)  # psutil.TimeoutExpired if it outlives its router
    finally:
        starter.kill()


def _request(model: str, rows: int = 1, seed: int = 0, **kwargs: object) -> bytes:
    return encode_request(model, {"features": features(rows, seed)}, **kwargs).SerializeToString()


async def test_the_unix_socket_answers_as_grpc_does(cpu_worker: WorkerProcess, root: Path) -> None:
    load(cpu_worker, "mlp")
    socket_path = root / "cpu.sock"
    assert cpu_worker.uds_target == f"uds:{socket_path}"
    assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600  # the file is the right to call
    local = UdsReplica(cpu_worker.uds_target)
    try:
        data = features(3, seed=7)
        request = encode_request("mlp", {"features": data}, request_id="r-1")
        replies = await asyncio.gather(*(local.call("ModelInfer", request.SerializeToString(), timeout_s=5)
                                         for _ in range(8)))  # many calls in flight on one connection
        with grpc.insecure_channel(cpu_worker.target) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            expected = stub.ModelInfer(request, timeout=5)
            metadata = stub.ModelMetadata(pb.ModelMetadataRequest(name="mlp"), timeout=5)
        assert all(pb.ModelInferResponse.FromString(reply) == expected for reply in replies)
        assert expected.id == "r-1" and expected.model_version == "1"
        scores = np.frombuffer(expected.raw_output_contents[0], dtype=np.float32).reshape(3, 4)
        np.testing.assert_allclose(scores, reference(root, "mlp", data), rtol=1e-5, atol=1e-6)
        assert await local.call("ModelMetadata", pb.ModelMetadataRequest(name="mlp").SerializeToString(),
                                timeout_s=5) == metadata.SerializeToString()
        ready = await local.call("ModelReady", pb.ModelReadyRequest(name="mlp", version="3").SerializeToString(),
                                 timeout_s=5)
        assert pb.ModelReadyResponse.FromString(ready).ready is False

        async def refused_locally(request: bytes, timeout_s: float = 5) -> ReplicaFailed:
            with pytest.raises(ReplicaFailed) as caught:
                await local.call("ModelInfer", request, timeout_s=timeout_s)
            return caught.value

        missing = await refused_locally(_request("nope"))
        assert (missing.code, missing.message, missing.retriable, missing.eject, missing.replica) == (
            "NOT_FOUND", "model 'nope' is not loaded on this worker (loaded: mlp)", True, True, cpu_worker.uds_target)
        wrong = await refused_locally(encode_request("mlp", {"features": data.astype(np.float64)}).SerializeToString())
        assert (wrong.code, wrong.message, wrong.retriable) == (
            "INVALID_ARGUMENT", "inputs[features]: expected FP32 [-1,16], got FP64 [3,16]", False)
        garbage = await refused_locally(b"\xff\xff\xff")
        assert garbage.code == "INVALID_ARGUMENT" and not garbage.retriable
        late = await refused_locally(_request("mlp"), timeout_s=1e-6)
        assert (late.code, late.retriable, late.eject) == ("DEADLINE_EXCEEDED", False, False)
    finally:
        await local.close()


def test_an_undeclared_kind_does_not_start(root: Path) -> None:
    with pytest.raises(RuntimeError, match=r"--pool-kind: must be a kind .* declares \(cpu, accel\), but got 'tpu'"):
        start_worker(root, "tpu")


async def test_large_frames_and_many_calls_in_flight_share_one_connection(tmp_path: Path) -> None:
    """The framing alone (an echoing servicer): frames split across reads, answers out of order."""
    class Echo(service_pb2_grpc.GRPCInferenceServiceServicer):
        async def ModelInfer(self, request: pb.ModelInferRequest, context: None) -> pb.ModelInferResponse:
            await asyncio.sleep(0.001 * (int(request.id) % 5))  # later calls may answer first
            return pb.ModelInferResponse(model_name=request.model_name, id=request.id,
                                         raw_output_contents=request.raw_input_contents)

    server = UdsServer(Echo(), tmp_path / "echo.sock", metrics=ServiceMetrics("inference-router-worker",
                                                                              registry=CollectorRegistry()))
    await server.start()
    local = UdsReplica(f"uds:{tmp_path / 'echo.sock'}")
    try:
        payloads = [np.random.default_rng(size).bytes(size) for size in (0, 1, 70_000, 4_000_000)] * 3
        requests = [pb.ModelInferRequest(model_name="m", id=str(i), raw_input_contents=[payload])
                    for i, payload in enumerate(payloads)]
        replies = await asyncio.gather(*(local.call("ModelInfer", request.SerializeToString(), timeout_s=30)
                                         for request in requests))
        for request, reply in zip(requests, replies):
            answer = pb.ModelInferResponse.FromString(reply)
            assert (answer.id, answer.raw_output_contents) == (request.id, request.raw_input_contents)
    finally:
        await local.close()
        await server.stop(1.0)
    assert not (tmp_path / "echo.sock").exists()


async def test_the_calls_of_one_read_are_answered_in_place_together_or_all_queued(tmp_path: Path) -> None:
    """A servicer with infer_now: the calls read together are offered to it together (one batch) and answered in
    the same turn; when it declines, each goes to ModelInfer; infer_now's errors keep their codes."""
    class Both(service_pb2_grpc.GRPCInferenceServiceServicer):
        def __init__(self) -> None:
            self.now: list[list[str]] = []
            self.queued: list[str] = []

        def infer_now(self, requests: list[pb.ModelInferRequest]) -> list[pb.ModelInferResponse | Exception] | None:
            ids = [request.id for request in requests]
            if ids == ["bad"]:
                raise InvalidArgument("inputs[x]", "is wrong")
            if "later" in ids:
                return None
            self.now.append(ids)
            return [pb.ModelInferResponse(id=i) if i != "odd" else InvalidArgument("inputs[y]", "is odd") for i in ids]

        async def ModelInfer(self, request: pb.ModelInferRequest, context: None) -> pb.ModelInferResponse:
            self.queued.append(request.id)
            return pb.ModelInferResponse(id=request.id)

    servicer = Both()
    server = UdsServer(servicer, tmp_path / "both.sock", metrics=ServiceMetrics("inference-router-worker",
                                                                                registry=CollectorRegistry()))
    await server.start()
    local = UdsReplica(f"uds:{tmp_path / 'both.sock'}")

    async def call(request_id: str) -> str:
        reply = await local.call("ModelInfer", pb.ModelInferRequest(model_name="m", id=request_id).SerializeToString(),
                                 timeout_s=30)
        return pb.ModelInferResponse.FromString(reply).id

    try:
        assert await call("alone") == "alone"
        assert await call("later") == "later"
        with pytest.raises(ReplicaFailed) as caught:
            await call("bad")
        assert (caught.value.code, caught.value.message) == ("INVALID_ARGUMENT", "inputs[x]: is wrong")
        together = [f"t{i}" for i in range(6)]  # sent in one write (the replica's writer joins a turn's frames)
        assert await asyncio.gather(*(call(request_id) for request_id in together)) == together
        mixed = await asyncio.gather(call("m1"), call("odd"), call("m2"), return_exceptions=True)
        assert mixed[0] == "m1" and mixed[2] == "m2"
        assert isinstance(mixed[1], ReplicaFailed) and mixed[1].message == "inputs[y]: is odd"
        assert await asyncio.gather(call("q1"), call("later"), call("q2")) == ["q1", "later", "q2"]
    finally:
        await local.close()
        await server.stop(1.0)
    assert servicer.now[:2] == [["alone"], together] and servicer.now[2] == ["m1", "odd", "m2"]
    assert servicer.queued == ["later", "q1", "later", "q2"]


async def test_report_frames_are_applied_in_order_and_never_answered(tmp_path: Path) -> None:
    """The front's reports: its service's report() takes them as read; the only answer on the wire is the call's."""
    taken: list[bytes] = []

    class Link:
        def report(self, body: bytes) -> None:
            taken.append(body)

        async def answer(self, kind: int, timeout_s: float | None, credential: bytes, body: bytes) -> tuple[int, bytes]:
            return OK, b"live"

        def count(self, kind: int, code: str) -> None:
            pass

    path = tmp_path / "link.sock"
    server = await asyncio.get_running_loop().create_unix_server(lambda: FrameServerConnection(Link()), str(path))
    reader, writer = await asyncio.open_unix_connection(str(path))
    try:
        writer.write(REQUEST.pack(3, 1, REPORT, 0.0, 0) + b"one" + REQUEST.pack(3, 2, REPORT, 0.0, 0) + b"two"
                     + REQUEST.pack(0, 3, KINDS["ServerLive"], 0.0, 0))
        length, call_id, status = RESPONSE.unpack(await reader.readexactly(RESPONSE.size))
        assert (call_id, status, await reader.readexactly(length)) == (3, OK, b"live")
        assert taken == [b"one", b"two"]
    finally:
        writer.close()
        server.close()
        await server.wait_closed()


def test_each_replica_runs_with_its_own_session_options(root: Path) -> None:
    """Two models on one worker, each with the options its load named (the serving configuration the
    router chose), read back from onnxruntime through ModelConfig; threads within the slot's share."""
    worker = WorkerProcess("cpu", root / "fleet.yaml", root / "options.log", models_dir=root / "models",
                           extra_args=("--threads-per-replica", "2")).start()
    try:
        client = triton.InferenceServerClient(worker.target)

        def options(model: str) -> tuple[str, str, str, str]:
            parameters = client.get_model_config(model).config.parameters
            return tuple(parameters[key].string_value for key in (  # type: ignore[return-value]
                "opml_threads", "opml_opt_level", "opml_execution_mode", "opml_batch_cap"))

        load(worker, "mlp", threads=2, opt_level="basic", execution_mode="parallel")
        load(worker, "q1")
        assert options("mlp") == ("2", "basic", "parallel", "32")
        assert options("q1") == ("2", "all", "sequential", "32")  # the worker's defaults: its slot's share
        data = features(3)
        np.testing.assert_allclose(infer(client, "mlp", data), reference(root, "mlp", data), rtol=1e-5, atol=1e-6)

        for bad, field in (({"threads": 3}, "threads"), ({"threads": 0}, "parameters[threads]"),
                           ({"opt_level": "max"}, "opt_level"),
                           ({"execution_mode": "async"}, "execution_mode")):
            with pytest.raises(grpc.RpcError) as caught:
                load(worker, "mlp", **bad)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details().startswith(field)
        with pytest.raises(grpc.RpcError) as caught:
            load(worker, "mlp", threads=3)
        assert "must be at most 2 (a slot's share of this cpu worker's cores), but got 3" in caught.value.details()

        load(worker, "mlp", version=1, max_batch=8)  # in place: the options stay
        assert options("mlp") == ("2", "basic", "parallel", "8")
        load(worker, "mlp", version=1, instances=1, max_batch=8, threads=1, opt_level="extended")  # reloaded
        # parallel with one thread is onnxruntime's sequential mode, and it says so
        assert options("mlp") == ("1", "extended", "sequential", "8")
        np.testing.assert_allclose(infer(client, "mlp", data), reference(root, "mlp", data), rtol=1e-5, atol=1e-6)
        assert options("q1") == ("2", "all", "sequential", "32")
    finally:
        worker.stop()
