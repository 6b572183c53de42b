"""Publishing CloudEvents to Kafka topics with acks=all."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    BrokerNotAvailableError,
    InvalidTopicError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    RecordTooLargeError,
)
from google.protobuf.message import Message

from opml_common.bus.cloudevents import CloudEvent
from opml_common.bus.security import describe, kafka_client_kwargs
from opml_common.config import PlatformSettings
from opml_common.errors import FailedPrecondition, OpmlError, Unavailable
from opml_common.lifecycle import Component
from opml_common.topics import Topic

if TYPE_CHECKING:  # prometheus_client: not imported by a publisher built without metrics
    from opml_common.metrics import ServiceMetrics

log = logging.getLogger(__name__)

# Refusals of the record itself: sent again it fails alike, while other records still go through.
# Not aiokafka's ``retriable`` flag, which is False for a timeout against a broker that is away too.
_RECORD_REFUSED = (MessageSizeTooLargeError, RecordTooLargeError, InvalidTopicError)
# The broker away or slow: aiokafka flags these not retriable (its own send gives up), but the same
# record sent again once the broker is back goes through, so a consumer retries its handler.
_BROKER_AWAY = (KafkaTimeoutError, BrokerNotAvailableError)


class PublishFailed(OpmlError):
    """The broker did not acknowledge a record. ``retriable`` tells whether trying again may succeed
    (a broker or network problem) or not (the record is too large, the topic is not authorized...).
    ``refused``: the record itself was refused (too large, an invalid topic name), so it never will be
    accepted while the records after it may (an outbox moves it aside instead of retrying it)."""

    code = "UNAVAILABLE"

    def __init__(self, message: str, *, retriable: bool, refused: bool = False) -> None:
        super().__init__(message)
        self.retriable = retriable
        self.refused = refused
        if not retriable:
            self.code = "INTERNAL"


class EventPublisher(Component):
    """Publishes CloudEvents (binary mode, ``ce_*`` headers) and waits for the broker's ack.

    The producer uses ``acks=all`` and ``enable_idempotence=settings.kafka_idempotence`` (on for
    Apache Kafka; tansu rejects the idempotent producer). Topics get ``settings.topic_prefix``.

    Side effects:
        ``start()``: connects to the brokers and fetches metadata. Idempotent; after ``stop()``
        it starts a fresh producer.
        ``stop()``: waits for every record in flight to be acknowledged (flush), then closes the
        connections. Idempotent.
        ``publish()``: one record; counts ``opml_<service>_events_published_total{topic,type}`` or
        ``opml_<service>_event_publish_failures_total{topic}`` (counted only with ``metrics``: a
        process nobody scrapes, the injected tracer, passes None and never imports prometheus_client).

    Use as ``async with EventPublisher(...) as publisher:``.
    """

    def __init__(self, settings: PlatformSettings, *, source: str, metrics: ServiceMetrics | None) -> None:
        if not source:
            raise ValueError("EventPublisher `source` must be non-empty (a URI-reference naming the service)")
        super().__init__()
        self.settings = settings
        self.source = source
        self._producer: AIOKafkaProducer | None = None
        self._published = self._failures = None
        if metrics is not None:
            self._published = metrics.counter(
                "events_published_total", "Events the broker acknowledged, by topic and event type.", ("topic", "type")
            )
            self._failures = metrics.counter(
                "event_publish_failures_total", "Records the broker did not acknowledge, by topic.", ("topic",)
            )

    @property
    def started(self) -> bool:
        return self._producer is not None

    async def on_start(self) -> None:
        """Connect the producer.

        Raises:
            Unavailable: no broker in ``settings.kafka_bootstrap`` answered.
        """
        producer = AIOKafkaProducer(
            **kafka_client_kwargs(self.settings),
            acks="all",
            enable_idempotence=self.settings.kafka_idempotence,
            client_id=f"opml-publisher-{self.source}",
        )
        try:
            await producer.start()
        except Exception as exc:
            await producer.stop()
            raise Unavailable(f"cannot reach the Kafka broker at {describe(self.settings)}: {exc}") from exc
        self._producer = producer

    async def on_stop(self) -> None:
        """Flush what is in flight and close."""
        producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()

    async def publish(self, topic: Topic, event: CloudEvent, *, key: str | None = None) -> None:
        """Publish ``event`` to ``topic`` and wait until the broker acknowledged it (acks=all).

        ``key`` (default ``event.subject``) picks the partition, so events about one subject stay
        in order. With neither, the partition is chosen at random.

        Raises:
            FailedPrecondition: the publisher is not started.
            PublishFailed: the broker did not acknowledge the record (``retriable`` says whether to retry).
        """
        name = topic.full_name(self.settings.topic_prefix)
        key = key if key is not None else event.subject
        await self._send(name, event.data, key=key.encode("utf-8") if key is not None else None,
                         headers=event.kafka_headers(), what=f"event {event.id} ({event.type})")
        if self._published is not None:
            self._published.labels(topic=topic.name, type=event.type).inc()

    async def publish_proto(
        self,
        topic: Topic,
        message: Message,
        *,
        subject: str,
        extensions: Mapping[str, str] | None = None,
    ) -> CloudEvent:
        """Wrap ``message`` in a new CloudEvent from this publisher's source, publish it keyed by
        ``subject``, and return the event. Raises what :meth:`publish` raises."""
        event = CloudEvent.from_proto(message, source=self.source, subject=subject, extensions=extensions)
        await self.publish(topic, event, key=subject)
        return event

    async def send_raw(
        self,
        topic_name: str,
        value: bytes | None,
        *,
        key: bytes | None = None,
        headers: Sequence[tuple[str, bytes]] = (),
    ) -> None:
        """Publish one record as it is, to a topic named in full (prefix included), and wait for
        the ack. The consumer uses it to copy a record to a dead-letter topic unchanged.

        Raises:
            FailedPrecondition: the publisher is not started.
            PublishFailed: the broker did not acknowledge the record.
        """
        await self._send(topic_name, value, key=key, headers=list(headers), what="record")

    async def _send(self, topic_name: str, value: bytes | None, *, key: bytes | None,
                    headers: list[tuple[str, bytes]], what: str) -> Any:
        producer = self._producer
        if producer is None:
            raise FailedPrecondition("EventPublisher is not started: call `await publisher.start()` or use `async with`")
        try:
            return await producer.send_and_wait(topic_name, value=value, key=key, headers=headers)
        except KafkaError as exc:
            if self._failures is not None:
                self._failures.labels(topic=self._metric_topic(topic_name)).inc()
            raise PublishFailed(f"publishing {what} to {topic_name} failed: {exc}",
                                retriable=exc.retriable or isinstance(exc, _BROKER_AWAY),
                                refused=isinstance(exc, _RECORD_REFUSED)) from exc

    def _metric_topic(self, topic_name: str) -> str:
        prefix = self.settings.topic_prefix
        return topic_name[len(prefix):] if prefix and topic_name.startswith(prefix) else topic_name
