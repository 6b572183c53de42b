"""The router end to end: tritonclient's gRPC client -> router frontend (in this process) -> REAL worker
processes running onnxruntime, over gRPC and over the workers' Unix sockets (``transport``), and the
real broker for prediction events."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as triton_sync
import tritonclient.grpc.aio as triton
from opml.inference.v1 import events_pb2
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from opml_common.bus import CloudEvent, EventPublisher, ensure_topics
from opml_common.config import PlatformSettings, ServiceSettings
from opml_common.grpc.server import GrpcServer
from opml_common.metrics import ServiceMetrics
from opml_devstack.testing.bus import read_records, sample, wait_until
from opml_inference_router.frontend import InferenceFrontend
from opml_inference_router.placement.fleet_config import load_fleet_config
from opml_inference_router.predictions import PredictionLog
from opml_inference_router.routing import ModelPolicy, Router
from opml_inference_router.routing.grpc_replica import GrpcReplica
from opml_inference_router.routing.local_replica import LocalReplica
from opml_inference_router.routing.replicas import Replica
from opml_inference_router.routing.uds_replica import connect as connect_replica
from opml_inference_router.runtime import ModelRepository, WorkerMetrics
from opml_inference_router.testing import mlp_classifier, mlp_config, write_model_dir
from opml_inference_router.worker.process import WorkerProcess
from opml_inference_router.worker.servicer import WorkerServicer
from opml_inference_router_contract.topics import PREDICTIONS

FLEET = Path(__file__).resolve().parents[1] / "examples" / "fleet.yaml"
MODEL = "mlp"
FEATURES = 16


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bundle of the test MLP with versions 1 and 2 (different weights, so answers tell them apart)."""
    root = tmp_path_factory.mktemp("bundle") / MODEL
    write_model_dir(root, mlp_config(MODEL, p99_ms=200), versions=(1,))
    write_model_dir(root, mlp_config(MODEL, p99_ms=200), mlp_classifier(features=FEATURES, seed=2), versions=(2,))
    return root


def _start_worker(bundle: Path, log: Path, *, token: str | None = None) -> WorkerProcess:
    """A worker serving versions 1 and 2, also on a Unix socket beside its log; with ``token``, its gRPC
    port requires that bearer token (admin)."""
    env = {"OPML_AUTH_TOKENS": f"{token}=admin"} if token else {}
    worker = WorkerProcess("cpu", FLEET, log, env=env, extra_args=("--threads-per-replica", "1"),
                           uds=log.with_suffix(".sock")).start()
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    try:
        with grpc.insecure_channel(worker.target) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            for version in (1, 2):
                request = pb.RepositoryModelLoadRequest(model_name=MODEL)
                request.parameters["path"].string_param = str(bundle)
                request.parameters["version"].int64_param = version
                stub.RepositoryModelLoad(request, timeout=30, metadata=metadata)
    except BaseException:
        worker.kill()
        raise
    return worker


@pytest.fixture(scope="module")
def workers(bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProcess]]:
    """Two worker processes, each serving versions 1 and 2 of the model; stopped after the module."""
    logs = tmp_path_factory.mktemp("workers")
    started: list[WorkerProcess] = []
    try:
        for index in range(2):
            started.append(_start_worker(bundle, logs / f"worker-{index}.log"))
        yield started
    finally:
        for worker in started:
            worker.stop()


@pytest.fixture(params=["grpc", "uds"])
def transport(request: pytest.FixtureRequest) -> str:
    """How the router reaches the workers: gRPC over TCP (remote workers) or their Unix sockets (local)."""
    return request.param


def _address(worker: WorkerProcess, transport: str) -> str:
    return worker.target if transport == "grpc" else worker.local_target


@contextlib.asynccontextmanager
async def router_serving(replicas: dict[str, list[str]], policy: ModelPolicy, *,
                         predictions: PredictionLog | None = None, metrics: ServiceMetrics | None = None,
                         connect: Callable[[str], Replica] = connect_replica,
                         ) -> AsyncIterator[tuple[Router, str, CollectorRegistry]]:
    """A router over real workers (``{version: [address]}``), its frontend served on a free port."""
    metrics = metrics or ServiceMetrics("inference-router", registry=CollectorRegistry())
    router = Router(connect=connect, metrics=metrics, rng=random.Random(11))
    router.set_model(MODEL, policy)
    for version, addresses in replicas.items():
        for address in addresses:
            router.add_replica(MODEL, version, address)
    frontend = InferenceFrontend(router, predictions=predictions)
    server = GrpcServer(settings=ServiceSettings(host="127.0.0.1", grpc_port=0, metrics_port=0),
                        platform=PlatformSettings(auth_tokens=""), metrics=metrics,
                        registrations=[frontend.registration()])
    async with server:
        try:
            yield router, f"127.0.0.1:{server.port}", metrics.registry
        finally:
            await router.close()


def _inputs(batch: int = 1, seed: int = 0) -> tuple[np.ndarray, list[triton.InferInput]]:
    data = np.random.default_rng(seed).standard_normal((batch, FEATURES)).astype(np.float32)
    tensor = triton.InferInput("features", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    return data, [tensor]


def _reference(bundle: Path, version: int, data: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(bundle / str(version) / "model.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, {"features": data})[0]


async def test_tritonclient_works_unchanged_through_the_router(workers: list[WorkerProcess], bundle: Path,
                                                               transport: str) -> None:
    addresses = [_address(w, transport) for w in workers]
    async with router_serving({"1": addresses, "2": addresses}, ModelPolicy(slo_p99_ms=200)) as (_, target, registry):
        client = triton.InferenceServerClient(target)
        try:
            assert await client.is_server_live() and await client.is_server_ready()
            assert await client.is_model_ready(MODEL) and await client.is_model_ready(MODEL, "2")
            assert not await client.is_model_ready(MODEL, "7") and not await client.is_model_ready("nope")
            metadata = await client.get_model_metadata(MODEL)
            assert metadata.name == MODEL and [i.name for i in metadata.inputs] == ["features"]
            data, inputs = _inputs(batch=3)
            misnamed = triton.InferInput("wrong", [1, FEATURES], "FP32")
            misnamed.set_data_from_numpy(data[:1])
            result = await client.infer(MODEL, inputs, request_id="r-1", client_timeout=10)
            response = result.get_response()
            assert response.model_version == "1" and response.id == "r-1"  # the stable version by default
            np.testing.assert_allclose(result.as_numpy("scores"), _reference(bundle, 1, data), rtol=1e-5)
            result = await client.infer(MODEL, inputs, model_version="2", client_timeout=10)
            np.testing.assert_allclose(result.as_numpy("scores"), _reference(bundle, 2, data), rtol=1e-5)
            with triton_sync.InferenceServerClient(target) as blocking:  # the plain (thread-blocking) client too
                sync_inputs = [triton_sync.InferInput("features", list(data.shape), "FP32")]
                sync_inputs[0].set_data_from_numpy(data)
                result = await asyncio.to_thread(blocking.infer, MODEL, sync_inputs, client_timeout=10)
            np.testing.assert_allclose(result.as_numpy("scores"), _reference(bundle, 1, data), rtol=1e-5)
            for call, code in [(client.infer("nope", inputs), "NOT_FOUND"),
                               (client.infer(MODEL, inputs, model_version="9"), "NOT_FOUND"),
                               (client.infer(MODEL, [misnamed]), "INVALID_ARGUMENT")]:
                with pytest.raises(InferenceServerException) as error:
                    await call
                assert error.value.status() == f"StatusCode.{code}", error.value
        finally:
            await client.close()
        assert sample(registry, "opml_inference_router_requests_total", model=MODEL, version="1", code="OK") == 2
        async with grpc.aio.insecure_channel(target) as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            for request, message in [(b"\x0a\x20truncated", "request: must be an inference.ModelInferRequest"),
                                     (pb.ModelInferRequest(id="x").SerializeToString(), "model_name: must name")]:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await infer(request, timeout=5)
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert error.value.details().startswith(message), error.value.details()


async def test_an_in_process_replica_serves_beside_remote_ones(workers: list[WorkerProcess], bundle: Path) -> None:
    metrics = ServiceMetrics("inference-router", registry=CollectorRegistry())
    cpu = next(kind for kind in load_fleet_config(FLEET).pool_kinds if kind.name == "cpu")
    repository = ModelRepository(cpu, metrics=WorkerMetrics(metrics), threads=1)
    await repository.load(MODEL, path=bundle, version=2)
    local = LocalReplica(WorkerServicer(repository, server_name="in-router", server_version="0"))

    def connect(address: str) -> GrpcReplica | LocalReplica:
        return local if address == "local" else GrpcReplica(address)

    policy = ModelPolicy(slo_p99_ms=200, hedge=False)
    try:
        async with router_serving({"1": [workers[0].target], "2": ["local"]}, policy, metrics=metrics,
                                  connect=connect) as (router, target, registry):
            client = triton.InferenceServerClient(target)
            try:
                data, inputs = _inputs(batch=2)
                result = await client.infer(MODEL, inputs, model_version="2", client_timeout=10)
                assert result.get_response().model_version == "2"
                np.testing.assert_allclose(result.as_numpy("scores"), _reference(bundle, 2, data), rtol=1e-5)
                metadata = await client.get_model_metadata(MODEL, "2")
                assert metadata.versions == ["2"]
                router.set_traffic(MODEL, {"1": 1, "2": 1})  # local and remote replicas side by side
                results = await asyncio.gather(*(client.infer(MODEL, inputs, client_timeout=10) for _ in range(40)))
                assert {r.get_response().model_version for r in results} == {"1", "2"}
                wrong = triton.InferInput("features", [2, FEATURES + 1], "FP32")
                wrong.set_data_from_numpy(np.zeros((2, FEATURES + 1), np.float32))
                with pytest.raises(InferenceServerException) as error:
                    await client.infer(MODEL, [wrong], model_version="2")
                assert error.value.status() == "StatusCode.INVALID_ARGUMENT" and "inputs[features]" in str(error.value)
            finally:
                await client.close()
            assert sample(registry, "opml_inference_router_requests_total", model=MODEL, version="2", code="OK") >= 2
    finally:
        await repository.close()


async def test_canary_split_then_promote_and_rollback(workers: list[WorkerProcess], transport: str) -> None:
    addresses = [_address(w, transport) for w in workers]
    # Room for the whole burst below, and an SLO it cannot break: admission sheds a wait past the SLO,
    # and this test is about the split, not about a burst of 400 on a loaded machine.
    policy = ModelPolicy(slo_p99_ms=10_000, max_queue=1000)
    async with router_serving({"1": addresses, "2": addresses}, policy) as (router, target, _):
        client = triton.InferenceServerClient(target)
        try:
            async def versions(count: int) -> Counter[str]:
                _, inputs = _inputs()
                results = await asyncio.gather(*(client.infer(MODEL, inputs, client_timeout=10) for _ in range(count)))
                return Counter(r.get_response().model_version for r in results)

            router.start_canary(MODEL, "2", 30)
            counts = await versions(400)
            assert counts["2"] / 400 == pytest.approx(0.30, abs=0.07)
            router.promote(MODEL)
            assert await versions(30) == {"2": 30}
            router.start_canary(MODEL, "1", 50)
            router.rollback(MODEL)
            assert await versions(30) == {"2": 30}
        finally:
            await client.close()


async def test_a_worker_killed_under_load_loses_no_request(workers: list[WorkerProcess], bundle: Path,
                                                           tmp_path: Path, transport: str) -> None:
    doomed = _start_worker(bundle, tmp_path / "doomed.log", token="router-secret")  # this one requires auth
    try:
        # No hedging: a call in flight on the held worker is then surely a first attempt, which the kill
        # breaks (with hedging, every call there may be a backup whose first attempt already won elsewhere).
        async with router_serving({"1": [_address(workers[0], transport), _address(doomed, transport)]},
                                  ModelPolicy(slo_p99_ms=200, max_concurrency=64, hedge=False),
                                  connect=partial(connect_replica, token="router-secret"),
                                  ) as (router, target, registry):
            client = triton.InferenceServerClient(target)
            outcomes: Counter[str] = Counter()
            stop = asyncio.Event()

            async def load(seed: int) -> None:
                _, inputs = _inputs(seed=seed)
                while not stop.is_set():
                    try:
                        await client.infer(MODEL, inputs, client_timeout=10)
                        outcomes["ok"] += 1
                    except InferenceServerException as error:
                        outcomes[error.status()] += 1

            def both_serving() -> bool:  # each replica answered enough requests to have a p50
                return all(r["p50_ms"] is not None for r in router.describe(MODEL)["versions"]["1"])

            def counts() -> dict[str, float]:
                found = {name: sample(registry, f"opml_inference_router_{name}_total", model=MODEL, version="1") or 0
                         for name in ("retries", "backup_requests", "backup_wins")}
                found["ejections"] = sample(registry, "opml_inference_router_replica_ejections_total", model=MODEL,
                                            version="1", replica=_address(doomed, transport)) or 0
                return found

            clients = [asyncio.create_task(load(i)) for i in range(16)]
            try:
                await wait_until(both_serving, timeout_s=20, what="both replicas serving")
                # Held, the doomed worker cannot answer what it has: the kill then surely breaks calls in
                # flight (unheld, a fast worker may have written every answer before the signal lands).
                doomed.process.send_signal(signal.SIGSTOP)
                await wait_until(lambda: _outstanding(router, _address(doomed, transport)) >= 2, timeout_s=10,
                                 what="requests in flight on the held worker")
                ok_before_kill = outcomes["ok"]
                doomed.kill()
                # The calls the kill broke are answered by the other replica: retried there.
                await wait_until(lambda: (c := counts())["retries"] >= 1 and c["ejections"] >= 1
                                 and outcomes["ok"] > ok_before_kill + 16, timeout_s=60,
                                 what=lambda: f"the broken calls answered elsewhere and the worker ejected: "
                                              f"{counts()}, ok {ok_before_kill} at the kill, now {dict(outcomes)}, "
                                              f"replicas {router.describe(MODEL)['versions']['1']}")
            finally:
                stop.set()
                await asyncio.gather(*clients)
                await client.close()
            assert set(outcomes) == {"ok"}, (outcomes, counts())
    finally:
        doomed.kill()


def _outstanding(router: Router, replica: str) -> int:
    return next(r["outstanding"] for r in router.describe(MODEL)["versions"]["1"] if r["replica"] == replica)


async def test_burst_over_capacity_is_shed_without_harm(workers: list[WorkerProcess]) -> None:
    # The worker is held (SIGSTOP) while the burst arrives, so exactly the admitted requests (4 in flight
    # + 8 queued) wait and every other one is shed, however fast or slow this machine sends them. The SLO
    # is far above how long the burst takes to arrive on a loaded machine: a queued request that has
    # waited past it is shed too (reason `slo`), which is another test's subject.
    policy = ModelPolicy(slo_p99_ms=120_000, max_concurrency=4, max_queue=8, hedge=False)
    admitted, burst = 4 + 8, 300
    async with router_serving({"1": [workers[0].target]}, policy) as (router, target, registry):
        client = triton.InferenceServerClient(target)
        worker = workers[0].process
        worker.send_signal(signal.SIGSTOP)
        try:
            _, inputs = _inputs(batch=32)
            sending = asyncio.gather(*(client.infer(MODEL, inputs, client_timeout=300) for _ in range(burst)),
                                     return_exceptions=True)

            def all_arrived() -> bool:
                state = router.describe(MODEL)
                shed = sample(registry, "opml_inference_router_shed_total", model=MODEL, reason="queue_full") or 0
                return state["in_flight"] == 4 and state["waiting"] == 8 and shed == burst - admitted

            while not all_arrived():
                await asyncio.wait({sending}, timeout=0.05)
                assert not sending.done(), "the burst ended while the worker was held"
        finally:
            worker.send_signal(signal.SIGCONT)
        try:
            results = await sending
            codes = Counter("ok" if not isinstance(r, Exception) else r.status() for r in results)
            assert codes == {"ok": admitted, "StatusCode.RESOURCE_EXHAUSTED": burst - admitted}, codes
            state = router.describe(MODEL)
            assert state["in_flight"] == 0 and state["waiting"] == 0
            await client.infer(MODEL, inputs, client_timeout=60)  # still serving
        finally:
            await client.close()


async def test_predictions_reach_the_topic(workers: list[WorkerProcess], platform_settings: PlatformSettings) -> None:
    metrics = ServiceMetrics("inference-router", registry=CollectorRegistry())
    await ensure_topics(platform_settings, [PREDICTIONS])
    async with EventPublisher(platform_settings, source="inference-router-test", metrics=metrics) as publisher:
        predictions = PredictionLog(publisher, metrics, record_cap_bytes=1024)

        def published() -> float:
            return sample(metrics.registry, "opml_inference_router_predictions_published_total")

        async with predictions, router_serving({"1": [w.target for w in workers]}, ModelPolicy(slo_p99_ms=200),
                                               predictions=predictions, metrics=metrics) as (_, target, registry):
            client = triton.InferenceServerClient(target)
            try:
                small, small_inputs = _inputs(batch=1)
                large, large_inputs = _inputs(batch=32)  # 2 KiB of features: over the 1 KiB cap
                # each published before the next is sent: one queued at a time is one PredictionMade
                # record (several queued for a version go out as one PredictionBatch)
                small_result = await client.infer(MODEL, small_inputs, request_id="small-1", client_timeout=10)
                await wait_until(lambda: published() == 1, what="small-1 published")
                await client.infer(MODEL, large_inputs, request_id="large-1", client_timeout=10)
                await wait_until(lambda: published() == 2, what="large-1 published")
                await client.infer(MODEL, small_inputs, client_timeout=10)  # no id: the router makes one up
            finally:
                await client.close()
    records = await read_records(platform_settings, PREDICTIONS.full_name(platform_settings.topic_prefix), 3)
    events = {}
    for record in records:
        event = CloudEvent.from_kafka(record.headers, record.value)
        assert event.type == "opml.inference.v1.PredictionMade" and record.key == f"{MODEL}/1".encode()
        made = event.parse(events_pb2.PredictionMade)
        events[made.request_id] = made
    made_up = set(events) - {"small-1", "large-1"}
    assert len(events) == 3 and len(made_up) == 1 and len(made_up.pop()) == 32
    small_event = events["small-1"]
    assert small_event.model_name == MODEL and small_event.model_version == "1" and small_event.latency_ms > 0
    request = pb.ModelInferRequest.FromString(small_event.infer_request)
    np.testing.assert_array_equal(np.frombuffer(request.raw_input_contents[0], np.float32).reshape(1, FEATURES), small)
    assert pb.ModelInferResponse.FromString(small_event.infer_response).raw_output_contents[0] == \
        small_result.get_response().raw_output_contents[0]
    large_event = events["large-1"]
    assert not large_event.infer_request and large_event.input_summaries[0].shape == [32, FEATURES]
    assert large_event.input_summaries[0].mean == pytest.approx(float(large.mean()), rel=1e-5)
    assert large_event.infer_response  # 32 x 4 scores fit under the cap
    assert sample(registry, "opml_inference_router_predictions_published_total") == 3
    assert sample(registry, "opml_inference_router_predictions_dropped_total", reason="queue_full") == 0
