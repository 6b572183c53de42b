"""The FederationService and FederatedClientService servicers: parse, call the coordinator, convert.

Client calls are identified by the client's own token (metadata ``x-opml-fl-client-token``, the
contract's ``CLIENT_TOKEN_HEADER``),
which the coordinator maps to one (federation, client id); a request naming another federation is
refused. The platform's bearer-token roles (``METHOD_ROLES``) apply on top, to every call.

An upload is read chunk by chunk into arrays of the task's model's shapes, and refused as soon as
a chunk goes past them; a client has one upload open at a time. So the coordinator holds at most
its arrays' bytes (float64 at most) per member with a task, whatever a member sends.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import numpy as np
from opml.fl.v1 import fl_pb2 as pb
from opml.fl.v1 import fl_pb2_grpc

from opml_common.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from opml_common.pagination import paginate
from opml_fl_coordinator import convert
from opml_fl_coordinator.coordinator import DONE, Coordinator
from opml_fl_coordinator.federation import Task
from opml_fl_coordinator.metrics import FlMetrics
from opml_fl_coordinator_contract.names import CLIENT_TOKEN_HEADER, federation_name
from opml_fl_coordinator_contract.weights import ArrayAssembler, Weights, chunks

log = logging.getLogger(__name__)

MAX_WAIT_S = 60.0
DEFAULT_WAIT_S = 10.0

FEDERATION_ROLES = {"CreateFederation": "writer", "GetFederation": "reader", "ListFederations": "reader",
                    "StopFederation": "writer", "ListRounds": "reader", "WatchRounds": "reader",
                    "RegisterClient": "writer", "DownloadWeights": "reader"}
# Clients need the platform's lowest role; who they are comes from their own token.
CLIENT_ROLES = {"Join": "reader", "Leave": "reader", "PullTask": "reader", "UploadUpdate": "reader",
                "ReportFailure": "reader"}
METHOD_ROLES = {**FEDERATION_ROLES, **CLIENT_ROLES}


class FederationServicer(fl_pb2_grpc.FederationServiceServicer):
    def __init__(self, coordinator: Coordinator, *, chunk_bytes: int, max_model_bytes: int,
                 metrics: FlMetrics) -> None:
        self._coordinator, self._chunk_bytes, self._metrics = coordinator, chunk_bytes, metrics
        self._max_model_bytes = max_model_bytes

    async def CreateFederation(self, request: pb.CreateFederationRequest, context) -> pb.Federation:
        return convert.federation_to_proto(await self._coordinator.create(request.config_yaml))

    async def GetFederation(self, request: pb.GetFederationRequest, context) -> pb.Federation:
        return convert.federation_to_proto(self._coordinator.get(convert.parse_federation_name("name", request.name)))

    async def ListFederations(self, request: pb.ListFederationsRequest, context) -> pb.ListFederationsResponse:
        page, token = paginate(self._coordinator.list(), request.page_size, request.page_token)
        return pb.ListFederationsResponse(federations=[convert.federation_to_proto(h) for h in page],
                                          next_page_token=token)

    async def StopFederation(self, request: pb.StopFederationRequest, context) -> pb.Federation:
        hosted = await self._coordinator.stop_federation(convert.parse_federation_name("name", request.name))
        return convert.federation_to_proto(hosted)

    async def ListRounds(self, request: pb.ListRoundsRequest, context) -> pb.ListRoundsResponse:
        federation_id = convert.parse_federation_name("parent", request.parent)
        history = self._coordinator.get(federation_id).federation.history
        page, token = paginate(history, request.page_size, request.page_token, query=federation_id)
        return pb.ListRoundsResponse(rounds=[convert.round_to_proto(federation_id, r) for r in page],
                                     next_page_token=token)

    async def WatchRounds(self, request: pb.WatchRoundsRequest, context) -> AsyncIterator[pb.Round]:
        federation_id = convert.parse_federation_name("parent", request.parent)
        async for record in self._coordinator.watch(federation_id):
            yield convert.round_to_proto(federation_id, record)

    async def RegisterClient(self, request: pb.RegisterClientRequest, context) -> pb.ClientCredential:
        federation_id = convert.parse_federation_name("parent", request.parent)
        token = await self._coordinator.register_client(federation_id, request.client_id, dict(request.labels))
        return pb.ClientCredential(federation=federation_name(federation_id), client_id=request.client_id,
                                   token=token)

    async def DownloadWeights(self, request: pb.DownloadWeightsRequest, context) -> AsyncIterator[pb.ArrayChunk]:
        """The global model as it is when the call comes (a round completing meanwhile replaces the
        list, not its arrays), in messages of at most ``chunk_bytes`` of data, ``max_model_bytes`` in all.

        Raises: FailedPrecondition: the model is larger than ``max_model_bytes`` (a model the
        coordinator would not take from a member is not sent either)."""
        federation = self._coordinator.get(convert.parse_federation_name("name", request.name)).federation
        weights = list(federation.weights or [])
        total = sum(np.asarray(array).nbytes for array in weights)
        if total > self._max_model_bytes:
            raise FailedPrecondition(f"the global model holds {total} bytes, more than max_model_bytes "
                                     f"({self._max_model_bytes})")
        for chunk in chunks(weights, self._chunk_bytes):
            self._metrics.bytes_out.inc(len(chunk.data))
            yield chunk


class FederatedClientServicer(fl_pb2_grpc.FederatedClientServiceServicer):
    def __init__(self, coordinator: Coordinator, *, chunk_bytes: int, max_model_bytes: int,
                 metrics: FlMetrics) -> None:
        self._coordinator, self._chunk_bytes, self._max_model_bytes = coordinator, chunk_bytes, max_model_bytes
        self._metrics = metrics
        self._uploading: set[tuple[str, str]] = set()

    def _client(self, context, federation: str) -> tuple[str, str]:
        """(federation id, client id) of the caller's token, which must be of ``federation``.

        Raises:
            Unauthenticated: no or unknown client token.
            PermissionDenied: the token is another federation's.
            InvalidArgument: ``federation`` is not a federation name.
        """
        metadata = dict(context.invocation_metadata() or ())
        federation_id, client_id = self._coordinator.authenticate(str(metadata.get(CLIENT_TOKEN_HEADER, "")))
        if convert.parse_federation_name("federation", federation) != federation_id:
            raise PermissionDenied(f"the client token is of another federation than {federation[:100]!r}")
        return federation_id, client_id

    async def Join(self, request: pb.JoinRequest, context) -> pb.JoinResponse:
        federation_id, client_id = self._client(context, request.federation)
        hosted = await self._coordinator.join(federation_id, client_id, request.num_examples)
        return pb.JoinResponse(client_id=client_id, state=convert.STATES[hosted.federation.phase],
                               chunk_bytes=self._chunk_bytes)

    async def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveResponse:
        await self._coordinator.leave(*self._client(context, request.federation))
        return pb.LeaveResponse()

    async def PullTask(self, request: pb.PullTaskRequest, context) -> AsyncIterator[pb.TaskChunk]:
        federation_id, client_id = self._client(context, request.federation)
        if not 0 <= request.wait_seconds <= MAX_WAIT_S:
            raise InvalidArgument("wait_seconds", f"must be in [0, {MAX_WAIT_S:g}], but got {request.wait_seconds}")
        task = await self._coordinator.pull(federation_id, client_id, request.wait_seconds or DEFAULT_WAIT_S)
        if task is None:
            return
        if task == DONE:
            yield pb.TaskChunk(header=convert.task_header(None))
            return
        yield pb.TaskChunk(header=convert.task_header(task))
        for chunk in chunks(list(task.weights or []), self._chunk_bytes):
            self._metrics.bytes_out.inc(len(chunk.data))
            yield pb.TaskChunk(chunk=chunk)

    async def UploadUpdate(self, request_iterator, context) -> pb.UploadUpdateResponse:
        messages = aiter(request_iterator)
        first = await anext(messages, None)
        if first is None or not first.HasField("header"):
            raise InvalidArgument("header", "the first message of an upload must be its header")
        header = first.header
        identity = self._client(context, header.federation)  # before reading any weights
        if identity in self._uploading:
            raise FailedPrecondition(f"client {identity[1]!r} is already uploading an update; one at a time")
        self._uploading.add(identity)
        try:
            task = await self._coordinator.admit(*identity, header.task_id, header.num_examples)
            if isinstance(task, str):
                return pb.UploadUpdateResponse(accepted=False, reason=task)  # late: the arrays are not read
            weights = await self._receive(messages, header, task)
        except InvalidArgument as error:
            if error.field != "header.num_examples":  # admit refused the task itself
                await self._coordinator.refuse(*identity, header.task_id, f"upload refused: {error.message}")
            raise
        finally:
            self._uploading.discard(identity)
        metrics, non_finite = convert.metrics_from_proto(header.metrics)
        if non_finite:
            log.warning("federation %s: client %s's update of task %d: non-finite metrics %s left out",
                        *identity, header.task_id, non_finite[:3])
            self._metrics.metrics_dropped.inc(len(non_finite))
        reason = await self._coordinator.upload(*identity, header.task_id, weights, header.num_examples, metrics)
        return pb.UploadUpdateResponse(accepted=reason is None, reason=reason or "")

    async def _receive(self, messages: AsyncIterator[pb.UpdateChunk], header: pb.UpdateHeader, task: Task) -> Weights:
        """The update's arrays, each chunk checked against the task's model (its starting weights,
        whose shapes nobody knows yet, against ``max_model_bytes``) as it arrives."""
        shapes = None if task.weights is None else [np.shape(w) for w in task.weights]
        assembler = ArrayAssembler(header.num_arrays, max_bytes=self._max_model_bytes, shapes=shapes)
        async for message in messages:
            if not message.HasField("chunk"):
                raise InvalidArgument("header", "an upload has exactly one header, first")
            assembler.add(message.chunk)
            self._metrics.bytes_in.inc(len(message.chunk.data))
        return assembler.result()

    async def ReportFailure(self, request: pb.ReportFailureRequest, context) -> pb.ReportFailureResponse:
        federation_id, client_id = self._client(context, request.federation)
        await self._coordinator.fail(federation_id, client_id, request.task_id, request.reason[:200])
        return pb.ReportFailureResponse()
