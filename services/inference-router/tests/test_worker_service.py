"""Real worker processes driven through tritonclient's KServe v2 gRPC client, as existing clients are."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tritonclient.grpc as triton
import yaml
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from opml_inference_router.testing import mlp_classifier, mlp_config, write_broken_onnx, write_model_dir
from opml_inference_router.worker import WorkerProcess

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
    write_model_dir(models / "slow", mlp_config("slow", max_queue_delay_us=300_000))
    write_model_dir(models / "broken", mlp_config("broken"))
    write_broken_onnx(models / "broken" / "model.onnx")
    for name in ("q1", "q2", "q3"):
        write_model_dir(models / name, mlp_config(name, classes=10), mlp_classifier(width=128, depth=3, classes=10))
    return root


def start_worker(root: Path, kind: str) -> WorkerProcess:
    return WorkerProcess(kind, root / "fleet.yaml", root / f"{kind}.log", models_dir=root / "models",
                         env={"OPML_LOG_FORMAT": "text"}).start()


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
    worker = start_worker(root, "cpu")
    try:
        load(worker, "slow")  # batches wait up to 300 ms to fill: requests sit queued when SIGTERM comes
        client = triton.InferenceServerClient(worker.target)
        with ThreadPoolExecutor(max_workers=4) as pool:
            pending = [pool.submit(infer, client, "slow", features(1, seed=i)) for i in range(4)]
            time.sleep(0.1)
            worker.process.send_signal(signal.SIGTERM)
            replies = [future.result(timeout=10) for future in pending]
        assert all(reply.shape == (1, 4) for reply in replies)
        assert worker.process.wait(timeout=15) == 0
    finally:
        worker.kill()


def test_an_undeclared_kind_does_not_start(root: Path) -> None:
    with pytest.raises(RuntimeError, match=r"--pool-kind: must be a kind .* declares \(cpu, accel\), but got 'tpu'"):
        start_worker(root, "tpu")
