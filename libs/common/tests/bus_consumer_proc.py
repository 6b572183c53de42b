"""A consumer process for the crash test: its effect is in Redis, applied atomically with the dedup mark.

Usage: python bus_consumer_proc.py TOPIC PARTITIONS GROUP DELAY_MS [HANG_AT]   (settings from OPML_*)

For each event it sleeps DELAY_MS, then in one MULTI: INCR ``{redis_prefix}count:{event id}``,
RPUSH the id onto ``{redis_prefix}handled`` and set the dedup mark. With HANG_AT, the handler hangs
right after the effect that makes ``handled`` HANG_AT long: the effect is applied, its offset not
committed, which is where a SIGKILL hurts most. Every redelivered event the dedup check skips is
counted in ``{redis_prefix}duplicates``. SIGTERM stops it gracefully; the test SIGKILLs it too.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from opml_common.bus import CloudEvent, EventConsumer, RedisDeduplicator
from opml_common.config import PlatformSettings
from opml_common.metrics import ServiceMetrics
from opml_common.storage import redis_client
from opml_common.topics import Topic


class CountingDeduplicator(RedisDeduplicator):
    async def seen(self, event_id: str) -> bool:
        found = await super().seen(event_id)
        if found:
            await self.redis.incr(self.prefix + "duplicates")
        return found


async def main(topic_name: str, partitions: int, group: str, delay_ms: int, hang_at: int | None) -> None:
    settings = PlatformSettings()
    redis = redis_client(settings)
    dedup = CountingDeduplicator(redis, prefix=settings.redis_prefix, group=group, ttl_s=3600)

    async def handler(event: CloudEvent) -> None:
        await asyncio.sleep(delay_ms / 1000)
        async with redis.pipeline(transaction=True) as pipe:
            pipe.incr(f"{settings.redis_prefix}count:{event.id}")
            pipe.rpush(f"{settings.redis_prefix}handled", event.id)
            dedup.mark_in(pipe, event.id)
            _, handled, _ = await pipe.execute()
        if handled == hang_at:
            print(f"hanging after the effect of event {event.id}", flush=True)
            await asyncio.Event().wait()

    consumer = EventConsumer(settings, group_id=group, topics=[Topic(topic_name, partitions)], handler=handler,
                             metrics=ServiceMetrics("bus-proc"), dedup=dedup)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await consumer.start()
        print("ready", flush=True)
        task = asyncio.create_task(consumer.run())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait([task, stopper], return_when=asyncio.FIRST_COMPLETED)
        await consumer.stop()
        stopper.cancel()
        await task
    finally:
        await consumer.stop()
        await redis.aclose()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    hang = int(sys.argv[5]) if len(sys.argv) > 5 else None
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), hang))
