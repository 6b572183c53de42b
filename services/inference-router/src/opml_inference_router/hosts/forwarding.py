"""Predictions a host served to its own clients: recorded to a durable outbox first, then forwarded
to the router (``ForwardPredictions``), which publishes them on the predictions topic.

An edge site cut off from the router keeps serving; its predictions wait on its disk
(:class:`~opml_common.outbox.Outbox`, fsync'd before the answer's record is counted as logged) and
go out, oldest first, once the link is back, at most ``rate_eps`` events a second, so a long
backlog does not fill the link its live traffic and heartbeats share. Delivery is at least once
with the event's id kept, so a batch re-sent after a lost answer is deduplicated downstream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import grpc
from google.protobuf.message import Message
from opml.inference.v1 import hosts_pb2 as pb
from opml.inference.v1 import hosts_pb2_grpc

from opml_common.bus.cloudevents import CloudEvent
from opml_common.errors import InvalidArgument
from opml_common.grpc.client import domain_error
from opml_common.outbox import Outbox
from opml_common.topics import Topic

FORWARD_TIMEOUT_S = 10.0


class OutboxRecorder:
    """What :class:`~opml_inference_router.predictions.PredictionLog` publishes through on a host:
    each record becomes a CloudEvent written to the outbox (durable before this returns)."""

    def __init__(self, outbox: Outbox, *, source: str) -> None:
        self.outbox = outbox
        self.source = source

    async def publish_proto(self, topic: Topic, message: Message, *, subject: str,
                            extensions: Mapping[str, str] | None = None) -> CloudEvent:
        event = CloudEvent.from_proto(message, source=self.source, subject=subject, extensions=extensions)
        self.outbox.record(topic, event)
        return event


class RouterForwarder:
    """The outbox's publisher: forwards one event per call to the router, paced to ``rate_eps``."""

    def __init__(self, channel: grpc.aio.Channel, *, host: str, token: str, rate_eps: float) -> None:
        if not rate_eps > 0:
            raise InvalidArgument("forward_rate_eps", f"must be > 0, but got {rate_eps}")
        self._stub = hosts_pb2_grpc.HostServiceStub(channel)
        self._host = host
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._interval_s = 1.0 / rate_eps
        self._next = 0.0

    async def publish(self, topic: Topic, event: CloudEvent) -> None:
        """Raises: the router's error as a domain error (Unavailable while the link is cut)."""
        delay = self._next - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        self._next = max(self._next, time.monotonic() - self._interval_s) + self._interval_s
        forwarded = pb.ForwardedEvent(headers=[pb.EventHeader(key=k, value=v) for k, v in event.kafka_headers()],
                                      data=event.data)
        try:
            await self._stub.ForwardPredictions(pb.ForwardPredictionsRequest(host=self._host, events=[forwarded]),
                                                timeout=FORWARD_TIMEOUT_S, metadata=self._metadata)
        except grpc.aio.AioRpcError as error:
            failure = domain_error(error)
            # the router refuses this event for good (not a prediction, malformed): the outbox sets it
            # aside; anything else (cut link, a token being fixed) is tried again and loses nothing
            failure.refused = isinstance(failure, InvalidArgument)  # type: ignore[attr-defined]
            raise failure from None
