"""The platform's event bus: CloudEvents over Kafka, at least once, with dedup and dead letters.

* :class:`CloudEvent` — CloudEvents 1.0, Kafka binding, binary mode; data is a protobuf message.
* :func:`ensure_topics` — create topics and their dead-letter topics at start-up.
* :class:`EventPublisher` — publish with acks=all and wait for the ack.
* :class:`EventConsumer` — consumer group loop: dedup, handler, retries, dead-letter topic, commit.
* :func:`kafka_client_kwargs` — the SASL/TLS arguments every Kafka client is built with.
* :class:`RedisDeduplicator` — handled event ids in Redis (``mark_in`` for exactly-once effects).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Loaded on first use (PEP 562): a process that only publishes (the injected tracer) imports
# ``opml_common.bus.producer`` without the consumer's Redis client or the admin client.
_WHERE = {
    "ensure_topics": "admin",
    "CloudEvent": "cloudevents", "MalformedEvent": "cloudevents",
    "EventConsumer": "consumer", "Handler": "consumer", "UntrustedSource": "consumer", "is_retriable": "consumer",
    "RedisDeduplicator": "dedup",
    "EventPublisher": "producer", "PublishFailed": "producer",
    "kafka_client_kwargs": "security",
}

if TYPE_CHECKING:
    from opml_common.bus.admin import ensure_topics
    from opml_common.bus.cloudevents import CloudEvent, MalformedEvent
    from opml_common.bus.consumer import EventConsumer, Handler, UntrustedSource, is_retriable
    from opml_common.bus.dedup import RedisDeduplicator
    from opml_common.bus.producer import EventPublisher, PublishFailed
    from opml_common.bus.security import kafka_client_kwargs


def __getattr__(name: str) -> object:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


__all__ = [
    "CloudEvent",
    "EventConsumer",
    "EventPublisher",
    "Handler",
    "MalformedEvent",
    "PublishFailed",
    "RedisDeduplicator",
    "UntrustedSource",
    "ensure_topics",
    "is_retriable",
    "kafka_client_kwargs",
]
