"""Topic administration: create the platform's topics (and their dead-letter topics) up front.

Topics are created explicitly at start-up with their partition counts: brokers that auto-create
topics give them a default count (tansu: 4), which breaks consumers that expect another.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError, for_code

from opml_common.bus.security import describe, kafka_client_kwargs
from opml_common.config import PlatformSettings
from opml_common.errors import OpmlError, Unavailable
from opml_common.topics import Topic

log = logging.getLogger(__name__)


async def ensure_topics(
    settings: PlatformSettings,
    topics: Sequence[Topic],
    *,
    replication_factor: int | None = None,
    request_timeout_ms: int = 30000,
) -> None:
    """Create each topic (``settings.topic_prefix`` applied) and its dead-letter topic, idempotently.

    Both get ``topic.partitions`` partitions and ``replication_factor`` replicas (default:
    ``settings.kafka_replication_factor``: 1 on tansu and a single broker, 3 on a production cluster). A topic that already exists is left as
    it is (a warning is logged when its partition count differs).

    Raises:
        Unavailable: the broker cannot be reached (retriable).
        OpmlError: the broker refused to create a topic (the message names it and the broker's error).
    """
    replication_factor = replication_factor or settings.kafka_replication_factor
    if replication_factor < 1:
        raise ValueError(f"`replication_factor` must be >= 1, but got {replication_factor}")
    wanted: dict[str, int] = {}
    for topic in topics:
        wanted[topic.full_name(settings.topic_prefix)] = topic.partitions
        wanted[topic.dead_letter(settings.topic_prefix)] = topic.partitions
    if not wanted:
        return

    admin = AIOKafkaAdminClient(**kafka_client_kwargs(settings), request_timeout_ms=request_timeout_ms)
    try:
        await admin.start()
    except Exception as exc:
        await admin.close()
        raise Unavailable(f"cannot reach the Kafka broker at {describe(settings)}: {exc}") from exc
    try:
        try:
            response = await admin.create_topics(
                [NewTopic(name, partitions, replication_factor) for name, partitions in wanted.items()],
                timeout_ms=request_timeout_ms,
            )
        except KafkaError as exc:
            if exc.retriable:
                raise Unavailable(f"creating topics on {settings.kafka_bootstrap} failed: {exc}") from exc
            raise OpmlError(f"creating topics on {settings.kafka_bootstrap} failed: {exc}") from exc
        existing: list[str] = []
        for topic_error in response.topic_errors:
            name, code = topic_error[0], topic_error[1]
            message = topic_error[2] if len(topic_error) > 2 else None
            if code == 0:
                log.info("created topic %s (%d partitions)", name, wanted[name])
            elif code == TopicAlreadyExistsError.errno:
                existing.append(name)
            else:
                error = for_code(code)
                raise OpmlError(f"creating topic {name!r} failed: {error.__name__} ({message or 'no message'})")
        if existing:
            # Only topics known to exist are described: describing an unknown topic can auto-create it.
            for described in await admin.describe_topics(existing):
                count = len(described.get("partitions", ()))
                if count != wanted[described["topic"]]:
                    log.warning(
                        "topic %s exists with %d partitions, but %d are configured; leaving it as it is",
                        described["topic"], count, wanted[described["topic"]],
                    )
    finally:
        await admin.close()
