"""One suite for every Replica (routing/replicas.py): the contract the router relies on, run against
each transport to the same scripted KServe servicer: gRPC (GrpcReplica, a grpc.aio server with the
platform's interceptor), the Unix socket (UdsReplica, the worker's UdsServer), in-process
(LocalReplica) and a host's worker (SeverableReplica over gRPC). What one transport alone does
(framing, a real worker's messages) stays in test_worker_service.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from opml_common.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from opml_common.grpc.interceptors import ObservabilityInterceptor
from opml_common.metrics import ServiceMetrics
from opml_inference_router.hosts.replicas import SeverableReplica
from opml_inference_router.routing.errors import ReplicaFailed
from opml_inference_router.routing.grpc_replica import GrpcReplica
from opml_inference_router.routing.local_replica import LocalReplica
from opml_inference_router.routing.replicas import Replica
from opml_inference_router.routing.uds_replica import UdsReplica
from opml_inference_router.worker.uds import UdsServer

ERRORS = {"not-loaded": NotFound("model 'not-loaded' is not loaded on this worker"),
          "bad-input": InvalidArgument("inputs[x]", "expected FP32 [-1,4], got FP64 [3,4]"),
          "busy": ResourceExhausted("the batch queue is full"),
          "stopping": Unavailable("the worker is shutting down")}


class Scripted(service_pb2_grpc.GRPCInferenceServiceServicer):
    """``ModelInfer`` by model name: a name in ERRORS raises that error; ``hold`` waits until it is
    cancelled (``started`` then ``cancelled`` are set); any other name answers with the request's id."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def ModelInfer(self, request: pb.ModelInferRequest, context) -> pb.ModelInferResponse:
        if request.model_name in ERRORS:
            raise ERRORS[request.model_name]
        if request.model_name == "hold":
            self.started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        return pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context) -> pb.ModelMetadataResponse:
        return pb.ModelMetadataResponse(name=request.name, versions=["1"], platform="onnxruntime_onnx")

    async def ModelReady(self, request: pb.ModelReadyRequest, context) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=request.name == "ok")


@dataclass
class Served:
    replica: Replica
    servicer: Scripted


def _metrics() -> ServiceMetrics:
    return ServiceMetrics("inference-router-worker", registry=CollectorRegistry())


@pytest.fixture(params=["grpc", "uds", "local", "host"])
async def served(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Served]:
    servicer = Scripted()
    if request.param in ("grpc", "host"):  # host: a host's worker, severable when its host is lost
        server = grpc.aio.server(interceptors=[ObservabilityInterceptor(_metrics())])
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        replica: Replica = GrpcReplica(f"127.0.0.1:{port}")
        if request.param == "host":
            replica = SeverableReplica(replica, "cloud")
        stop: Callable = lambda: server.stop(0)  # noqa: E731
    elif request.param == "uds":
        uds = UdsServer(servicer, tmp_path / "w.sock", metrics=_metrics())
        await uds.start()
        replica, stop = UdsReplica(f"uds:{tmp_path / 'w.sock'}"), lambda: uds.stop(0)
    else:
        replica, stop = LocalReplica(servicer, name="in-process"), None
    try:
        yield Served(replica, servicer)
    finally:
        await replica.close()
        if stop is not None:
            await stop()


def infer_request(model: str, request_id: str = "r-1") -> bytes:
    return pb.ModelInferRequest(model_name=model, id=request_id).SerializeToString()


async def refused(replica: Replica, request: bytes, *, timeout_s: float = 5.0) -> ReplicaFailed:
    with pytest.raises(ReplicaFailed) as caught:
        await replica.call("ModelInfer", request, timeout_s=timeout_s)
    return caught.value


async def test_every_call_answers_with_the_servicers_reply_bytes(served: Served) -> None:
    replica = served.replica
    replies = await asyncio.gather(*(replica.call("ModelInfer", infer_request("ok", str(i)), timeout_s=5)
                                     for i in range(8)))  # many calls in flight at once
    assert [pb.ModelInferResponse.FromString(r).id for r in replies] == [str(i) for i in range(8)]
    assert replies[0] == pb.ModelInferResponse(model_name="ok", model_version="1", id="0").SerializeToString()
    metadata = await replica.call("ModelMetadata", pb.ModelMetadataRequest(name="ok").SerializeToString(), timeout_s=5)
    assert pb.ModelMetadataResponse.FromString(metadata).versions == ["1"]
    ready = await replica.call("ModelReady", pb.ModelReadyRequest(name="ok").SerializeToString(), timeout_s=5)
    assert pb.ModelReadyResponse.FromString(ready).ready is True


@pytest.mark.parametrize(("model", "expected"), [
    ("not-loaded", ("NOT_FOUND", True, True)),
    ("bad-input", ("INVALID_ARGUMENT", False, False)),
    ("busy", ("RESOURCE_EXHAUSTED", True, False)),
    ("stopping", ("UNAVAILABLE", True, True)),
])
async def test_a_servicer_error_is_the_same_failure_on_every_transport(served: Served, model: str,
                                                                      expected: tuple[str, bool, bool]) -> None:
    failure = await refused(served.replica, infer_request(model))
    assert (failure.code, failure.retriable, failure.eject) == expected
    assert failure.message == ERRORS[model].message
    assert failure.replica == served.replica.name


async def test_a_passed_deadline_is_deadline_exceeded_neither_retried_nor_ejecting(served: Served) -> None:
    failure = await refused(served.replica, infer_request("hold"), timeout_s=0.05)
    assert (failure.code, failure.retriable, failure.eject) == ("DEADLINE_EXCEEDED", False, False)
    await asyncio.wait_for(served.servicer.cancelled.wait(), 5)  # the servicer stops working on it too


async def test_a_cancelled_call_ends_at_once_and_the_servicer_drops_it(served: Served) -> None:
    call = asyncio.create_task(served.replica.call("ModelInfer", infer_request("hold"), timeout_s=30))
    await served.servicer.started.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await asyncio.wait_for(served.servicer.cancelled.wait(), 5)
    reply = await served.replica.call("ModelInfer", infer_request("ok"), timeout_s=5)  # the replica still serves
    assert pb.ModelInferResponse.FromString(reply).model_name == "ok"


async def test_close_is_idempotent(served: Served) -> None:
    await served.replica.close()
    await served.replica.close()


# -- remote transports: an address nobody serves --------------------------------------------------


@pytest.mark.parametrize("transport", ["grpc", "uds"])
async def test_an_address_nobody_serves_is_unavailable_so_the_router_retries_elsewhere(transport: str,
                                                                                      tmp_path: Path) -> None:
    replica: Replica = GrpcReplica("127.0.0.1:1") if transport == "grpc" else UdsReplica(f"uds:{tmp_path / 'gone.sock'}")
    try:
        failure = await refused(replica, b"", timeout_s=1)
        assert (failure.code, failure.retriable, failure.eject) == ("UNAVAILABLE", True, True)
    finally:
        await replica.close()
