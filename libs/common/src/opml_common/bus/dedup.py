"""Event-id deduplication in Redis, so at-least-once delivery gives an effectively-once effect."""

from __future__ import annotations

from typing import Any

DEFAULT_TTL_S = 7 * 24 * 3600


class RedisDeduplicator:
    """Remembers which event ids a consumer group has handled.

    One key per event: ``{prefix}dedup:{group}:{event id}`` (value ``1``), expiring after ``ttl_s``
    (default 7 days, longer than any redelivery window). ``prefix`` is ``settings.redis_prefix``.
    The key is per group: two groups reading the same topic each handle every event once.

    Two ways to mark an event handled:

    * :meth:`mark` after the effect, as :class:`~opml_common.bus.consumer.EventConsumer` does. A crash
      between the effect and the mark replays the effect, so the handler must be idempotent.
    * :meth:`mark_in` inside the handler's own ``MULTI`` pipeline, when the effect lives in the same
      Redis: effect and mark commit together, so the effect happens exactly once.

    Redis errors (``redis.exceptions.ConnectionError``/``TimeoutError``) propagate; the consumer
    retries them.
    """

    def __init__(self, redis: Any, *, prefix: str, group: str, ttl_s: int = DEFAULT_TTL_S) -> None:
        if not group:
            raise ValueError("RedisDeduplicator `group` must be non-empty, but got ''")
        if ttl_s <= 0:
            raise ValueError(f"RedisDeduplicator `ttl_s` must be > 0, but got {ttl_s}")
        self.redis = redis
        self.prefix = prefix
        self.group = group
        self.ttl_s = int(ttl_s)

    def key(self, event_id: str) -> str:
        """The Redis key that marks ``event_id`` handled."""
        return f"{self.prefix}dedup:{self.group}:{event_id}"

    async def seen(self, event_id: str) -> bool:
        """True when ``event_id`` was marked handled (and the mark has not expired)."""
        return bool(await self.redis.exists(self.key(event_id)))

    async def mark(self, event_id: str) -> None:
        """Mark ``event_id`` handled (idempotent; refreshes the TTL)."""
        await self.redis.set(self.key(event_id), b"1", ex=self.ttl_s)

    def mark_in(self, pipeline: Any, event_id: str) -> None:
        """Queue the mark in ``pipeline`` (a ``redis.pipeline(transaction=True)``), to apply it
        atomically with the handler's own commands when the pipeline executes."""
        pipeline.set(self.key(event_id), b"1", ex=self.ttl_s)
