"""The router's HostService (``opml.inference.v1.HostService``): what host agents call, with a host token.

A host token (``OPML_INFERENCE_ROUTER_HOST_TOKENS``) lets its holder call these three RPCs and
nothing else (a scoped principal: no inference, no deploy); the platform's own tokens need admin.
``ForwardPredictions`` publishes only prediction events, on the predictions topic, unchanged (their
ids stay, so a batch forwarded twice after a lost answer is deduplicated downstream).
"""

from __future__ import annotations

import hmac
import logging

import grpc
from opml.inference.v1 import events_pb2, hosts_pb2_grpc
from opml.inference.v1 import hosts_pb2 as pb

from opml_common.bus.cloudevents import CloudEvent
from opml_common.config import token_fingerprint
from opml_common.errors import InvalidArgument
from opml_common.grpc.interceptors import Principal, Scope
from opml_common.grpc.server import ServiceRegistration
from opml_inference_router.hosts.registry import HostRegistry, RequestedPool
from opml_inference_router_contract.topics import PREDICTIONS

log = logging.getLogger(__name__)

HOST_METHODS = frozenset({"RegisterHost", "Heartbeat", "ForwardPredictions"})
MAX_FORWARDED_EVENTS = 1000
PREDICTION_TYPES = frozenset({events_pb2.PredictionMade.DESCRIPTOR.full_name,
                              events_pb2.PredictionBatch.DESCRIPTOR.full_name})


def host_token_verifier(tokens: list[str]):
    """A :data:`~opml_common.grpc.interceptors.TokenVerifier` for the configured host tokens."""
    known = [token for token in tokens if token]

    def verify(token: str) -> Principal | None:
        for candidate in known:
            if hmac.compare_digest(candidate.encode(), token.encode()):
                return Principal(f"host:{token_fingerprint(token)}", frozenset({"admin"}),
                                 Scope("a host token", HOST_METHODS, None))
        return None

    return verify


class HostServicer(hosts_pb2_grpc.HostServiceServicer):
    def __init__(self, registry: HostRegistry, publisher, *, host_tokens: list[str]) -> None:
        self.registry = registry
        self._publisher = publisher
        self._verifier = host_token_verifier(host_tokens)

    def registration(self) -> ServiceRegistration:
        return ServiceRegistration(pb.DESCRIPTOR.services_by_name["HostService"],
                                   hosts_pb2_grpc.add_HostServiceServicer_to_server, self,
                                   dict.fromkeys(("RegisterHost", "Heartbeat", "ForwardPredictions"), "admin"),
                                   token_verifier=self._verifier)

    async def RegisterHost(self, request: pb.RegisterHostRequest,
                           context: grpc.aio.ServicerContext) -> pb.RegisterHostResponse:
        pools = [RequestedPool(p.pool, p.kind, p.slots, p.site) for p in request.pools]
        workers = self.registry.register(request.host, pools, request.agent_address)
        return pb.RegisterHostResponse(workers=workers, worker_token=self.registry.worker_token,
                                       heartbeat_interval_s=self.registry.heartbeat_interval_s)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        await self.registry.heartbeat(request.host, {w.worker: w.address for w in request.workers})
        return pb.HeartbeatResponse()

    async def ForwardPredictions(self, request: pb.ForwardPredictionsRequest,
                                 context: grpc.aio.ServicerContext) -> pb.ForwardPredictionsResponse:
        if len(request.events) > MAX_FORWARDED_EVENTS:
            raise InvalidArgument("events", f"must hold at most {MAX_FORWARDED_EVENTS}, but holds {len(request.events)}")
        if request.host not in self.registry.hosts:
            raise InvalidArgument("host", f"must be a registered host, but got {request.host!r}")
        events, problems = [], []
        for index, forwarded in enumerate(request.events):
            try:
                event = CloudEvent.from_kafka([(h.key, h.value) for h in forwarded.headers], forwarded.data)
            except Exception as error:  # noqa: BLE001 - any malformed event is the caller's mistake
                problems.append((f"events[{index}]", f"must be a CloudEvent in binary mode: {error}"))
                continue
            if event.type not in PREDICTION_TYPES:
                problems.append((f"events[{index}].type", f"must be one of {', '.join(sorted(PREDICTION_TYPES))}, "
                                                          f"but got {event.type!r}"))
            events.append(event)
        if problems:
            raise InvalidArgument.of(problems)
        for event in events:  # in order: the outbox's order, so a version's predictions stay ordered
            await self._publisher.publish(PREDICTIONS, event)
        return pb.ForwardPredictionsResponse(published=len(events))
