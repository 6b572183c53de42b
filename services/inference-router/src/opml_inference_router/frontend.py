"""The router's KServe v2 (Open Inference Protocol) gRPC front: what clients such as tritonclient call.

A thin servicer over :class:`~opml_inference_router.routing.Router`. ``ModelInfer`` is registered
with no (de)serializers: the request arrives as wire bytes, only its routing header is read
(:mod:`.routing.wire`), and the worker's response bytes go back as they came, so the router never
decodes tensors. Errors are platform errors; the server's interceptor maps them to status codes
(unknown model or version: NOT_FOUND; overload: RESOURCE_EXHAUSTED; no replica: UNAVAILABLE; a
worker's own refusal, such as INVALID_ARGUMENT for a bad tensor, is passed on with its message).

Sizes: a request longer than its model's limit (:mod:`.routing.limits`, from the model's config) is
INVALID_ARGUMENT on field ``request`` from its length alone, before it is copied or forwarded; one
longer than the server's receive cap (``OPML_INFERENCE_ROUTER_GRPC_MAX_RECEIVE_BYTES``, 16 MiB) is
refused by gRPC itself (RESOURCE_EXHAUSTED) and never reaches this servicer.
"""

from __future__ import annotations

import time
import uuid

import grpc
from tritonclient.grpc import service_pb2 as pb

from opml_common.errors import InvalidArgument
from opml_common.grpc.server import ServiceRegistration
from opml_inference_router import package_version
from opml_inference_router.kserve.roles import INFERENCE_METHOD_ROLES
from opml_inference_router.predictions import PredictionLog
from opml_inference_router.routing import Router, wire

SERVICE = "inference.GRPCInferenceService"
SERVER_NAME = "opml-inference-router"


_METADATA_TIMEOUT_S = 5.0


class InferenceFrontend:
    """GRPCInferenceService for the router: health of the router, per-model readiness, inference."""

    def __init__(self, router: Router, *, predictions: PredictionLog | None = None) -> None:
        self.router = router
        self.predictions = predictions
        self._version = package_version()
        # The owner sets it False when it starts draining: ServerReady says no, so balancers move away.
        self.accepting = True

    async def ServerLive(self, request: pb.ServerLiveRequest,
                         context: grpc.aio.ServicerContext) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest,
                          context: grpc.aio.ServicerContext) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.accepting)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest,
                             context: grpc.aio.ServicerContext) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=self._version)

    async def ModelReady(self, request: pb.ModelReadyRequest,
                         context: grpc.aio.ServicerContext) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=self.router.is_ready(request.name, request.version))

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext) -> bytes:
        return await self.model_metadata(request, context.time_remaining())

    async def model_metadata(self, request: pb.ModelMetadataRequest, timeout_s: float | None) -> bytes:
        """Answered by a replica of the version (default: the stable one), bytes passed through."""
        if not request.name:
            raise InvalidArgument("name", "must name a served model, but got ''")
        return await self.router.forward("ModelMetadata", request.name, request.version, request.SerializeToString(),
                                         timeout_s=timeout_s or _METADATA_TIMEOUT_S)

    async def ModelInfer(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self.infer(request, context.time_remaining())

    async def infer(self, request: bytes, timeout_s: float | None) -> bytes:
        """A ModelInferRequest's wire bytes to the response's, within ``timeout_s`` (None: the model's
        default); both fronts (this servicer, the native front's link) call it."""
        predictions = self.predictions
        if predictions is not None:  # timed only for the log: the router's own metrics time the rest
            received, start = time.time(), time.perf_counter()
        try:
            header = wire.read_header(request)
        except wire.MalformedMessage as exc:
            raise InvalidArgument("request", f"must be an inference.ModelInferRequest, but {exc}") from None
        if not header.model_name:
            raise InvalidArgument("model_name",
                                  f"must name a served model, but got '' (served: {self.router.models()})")
        routed = await self.router.infer(header.model_name, header.model_version, request,
                                         request_id=header.request_id, timeout_s=timeout_s)
        response = routed.response
        if not wire.version_leads(response):
            response = wire.with_field(response, wire.MODEL_VERSION, routed.version)
        if predictions is not None:
            predictions.record(request_id=header.request_id or uuid.uuid4().hex, model=header.model_name,
                               routed=routed, request=request, response=response, received=received,
                               latency_s=time.perf_counter() - start)
        return response

    def registration(self) -> ServiceRegistration:
        """What ``GrpcServer`` needs to host this servicer."""
        return ServiceRegistration(pb.DESCRIPTOR.services_by_name["GRPCInferenceService"],
                                   add_to_server, self, INFERENCE_METHOD_ROLES)


def _raw(data: bytes) -> bytes:
    return data


def add_to_server(frontend: InferenceFrontend, server: grpc.aio.Server) -> None:
    """Register the frontend's methods; ModelInfer and ModelMetadata responses stay bytes end to end."""
    def typed(behavior, message: type, raw_response: bool = False) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            behavior, request_deserializer=message.FromString,
            response_serializer=_raw if raw_response else (lambda reply: reply.SerializeToString()))

    handlers = {
        "ServerLive": typed(frontend.ServerLive, pb.ServerLiveRequest),
        "ServerReady": typed(frontend.ServerReady, pb.ServerReadyRequest),
        "ServerMetadata": typed(frontend.ServerMetadata, pb.ServerMetadataRequest),
        "ModelReady": typed(frontend.ModelReady, pb.ModelReadyRequest),
        "ModelMetadata": typed(frontend.ModelMetadata, pb.ModelMetadataRequest, raw_response=True),
        # No (de)serializer: grpc hands over and sends the wire bytes themselves.
        "ModelInfer": grpc.unary_unary_rpc_method_handler(frontend.ModelInfer),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
