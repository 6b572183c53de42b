"""Nudges between replicas: a Redis pub/sub channel that tells the leader at once what a follower did.

A follower serves CreateExperiment, StopExperiment and ResumeExperiment by writing the record, and
its Trace consumer stores a trial's epochs; the experiment's loop and the trial's runner are the
leader's. A nudge (``experiment {name}``, ``trace {job id}``) wakes them now rather than at the
leader's next resync. Nudges are hints, lost while no leader listens (pub/sub keeps nothing): what
they point at is in Redis, and the leader's resync (and a new leader's take-over) reads it all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from opml_common.lifecycle import Component, cancel_and_wait

log = logging.getLogger(__name__)

EXPERIMENT = "experiment"
TRACE = "trace"
KINDS = (EXPERIMENT, TRACE)
_RETRY_S = 0.5


class Nudges(Component):
    """Publishes and receives nudges on ``{prefix}automl:nudges``.

    Args:
        redis: the service's client (a pub/sub connection of its own is taken from its pool).
        prefix: the platform's Redis prefix.
        on_nudge: called on the loop with (kind, value) for each nudge received (this replica's own
            included); a malformed one is logged and dropped.
    """

    def __init__(self, redis: aioredis.Redis, *, prefix: str, on_nudge: Callable[[str, str], None]) -> None:
        super().__init__()
        self._redis = redis
        self.channel = f"{prefix}automl:nudges"
        self._on_nudge = on_nudge
        self._task: asyncio.Task | None = None
        self._subscribed = asyncio.Event()

    async def on_start(self) -> None:
        """Subscribes (waits for the subscription, so nothing published after start is missed)."""
        self._task = asyncio.create_task(self._listen(), name="automl nudges")
        waiter = asyncio.ensure_future(self._subscribed.wait())
        await asyncio.wait([waiter, self._task], return_when=asyncio.FIRST_COMPLETED)
        await cancel_and_wait(waiter)
        if self._task.done():
            self._task.result()  # its error

    async def on_stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def publish(self, kind: str, value: str) -> None:
        """Best effort: a nudge that cannot be sent is logged (the leader's resync finds the change)."""
        try:
            await self._redis.publish(self.channel, f"{kind} {value}")
        except RedisError as error:
            log.warning("nudge %s %s not sent (%s); the leader's resync finds it", kind, value, error)

    async def _listen(self) -> None:
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                self._subscribed.set()
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        self._deliver(message["data"])
            except RedisError as error:
                log.warning("nudges: subscription broke (%s); subscribing again", error)
                await asyncio.sleep(_RETRY_S)
            finally:
                await pubsub.aclose()

    def _deliver(self, data: bytes) -> None:
        kind, _, value = data.decode(errors="replace").partition(" ")
        if kind not in KINDS or not value:
            log.warning("nudges: dropped a malformed nudge %r", data[:100])
            return
        self._on_nudge(kind, value)
