"""The aggregator's consumer, bound to the generation of the Redis state it builds.

Redis holds hot state only; the facts are the events in opml.traces.v1 (DESIGN: "a service
restarted with its Redis keys gone rebuilds what it needs"). The state's generation id
(:meth:`TraceStore.generation`) names the consumer group, ``{group}.{generation}``:

* state present: the group of its generation resumes from its committed offsets (no replay);
* state missing at start (first start, or Redis lost its keys): a new generation, a group with no
  offsets, which reads the topic from its beginning (``auto_offset_reset=earliest``) and rebuilds
  the state (the aggregation is idempotent and order-tolerant), then carries on live;
* state gone while running (Redis flushed or replaced): noticed within ``check_interval_s``; the
  consumer finishes the event in hand, leaves its group, and a new generation rebuilds as above.

A new group rather than seeking the old one back to the start: it needs nothing of the broker
beyond plain consumer groups (tansu included), every replica that reads the same generation joins
the same group, and a replica that restarts mid-rebuild resumes the rebuild where it stopped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis.exceptions

from opml_common.bus import EventConsumer
from opml_common.lifecycle import Component, cancel_and_wait
from opml_common.metrics import ServiceMetrics
from opml_trace_collector.store import TraceStore

log = logging.getLogger(__name__)


class RebuildingConsumer(Component):
    """Runs ``make_consumer(group)`` for the state's current generation; starts over when it changes.

    Side effects:
        ``start()``: reads or creates the generation (creating it counts a rebuild) and joins its
        group (see :meth:`EventConsumer.start`). Idempotent.
        ``run()``: handles events until ``stop()``; meanwhile checks the generation every
        ``check_interval_s`` and, when the state is gone, moves to a new generation's group.
        ``stop()``: stops the current consumer (the event in hand is finished). Idempotent and final:
        ``start()`` after it joins no group, and ``run()`` returns at once.
        Metric ``opml_<service>_state_rebuilds_total``: times this process began building the state
        from the beginning of the topic.
    """

    def __init__(self, store: TraceStore, make_consumer: Callable[[str], EventConsumer], *, base_group: str,
                 metrics: ServiceMetrics, check_interval_s: float = 5.0) -> None:
        if check_interval_s <= 0:
            raise ValueError(f"RebuildingConsumer `check_interval_s` must be > 0, but got {check_interval_s}")
        super().__init__()
        self.store = store
        self.make_consumer = make_consumer
        self.base_group = base_group
        self.check_interval_s = check_interval_s
        self.generation: str | None = None
        self._consumer: EventConsumer | None = None
        self._stopping = asyncio.Event()
        self._rebuilds = metrics.counter("state_rebuilds_total", "Times this process began building its Redis "
                                         "state from the beginning of the topic (the state was missing).")

    async def on_start(self) -> None:
        """Join the group of the state's generation (nothing once stopped: a stop is final)."""
        if not self._stopping.is_set():
            await self._join()

    async def _join(self) -> None:
        """Join the group of the state's generation (a new one when the state is missing)."""
        generation, created = await self.store.generation()
        group = f"{self.base_group}.{generation}"
        if created:
            self._rebuilds.inc()
            log.warning("no trace-collector state in Redis (a first start, or its keys were lost): building it from "
                        "the beginning of the topic with the new consumer group %s", group)
        consumer = self.make_consumer(group)
        await consumer.start()
        self.generation, self._consumer = generation, consumer

    async def run(self) -> None:
        """Handle events until :meth:`stop`, moving to a new generation when the state is lost.

        Raises what :meth:`EventConsumer.run` raises (a consumer that died).
        """
        await self.start()
        while not self._stopping.is_set():
            consumer = self._consumer
            consuming = asyncio.create_task(consumer.run())
            watching = asyncio.create_task(self._until_state_lost())
            await asyncio.wait({consuming, watching}, return_when=asyncio.FIRST_COMPLETED)
            await cancel_and_wait(watching)
            lost = not consuming.done() and not self._stopping.is_set()
            await consumer.stop()
            await consuming  # re-raises the failure of a consumer that died
            if not lost:
                return
            log.warning("the trace-collector state (generation %s) is gone from Redis; starting over", self.generation)
            self._consumer = None
            await self._join()
        if self._consumer is not None:
            await self._consumer.stop()  # stop() came while a new generation's group was being joined

    async def stop(self) -> None:
        """Stop consuming (the event in hand is finished first). Final: a stopped one is not started again.

        The flag is set before the part's own stop, which waits for a join in progress: ``run()``
        sees it as soon as that join is done.
        """
        self._stopping.set()
        await super().stop()

    async def on_stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()

    async def _until_state_lost(self) -> None:
        """Return once the generation in Redis is no longer this consumer's (Redis errors: keep looking)."""
        while True:
            await asyncio.sleep(self.check_interval_s)
            try:
                current = await self.store.current_generation()
            except redis.exceptions.RedisError as exc:
                log.warning("could not check the state's generation: %s", exc)
                continue
            if current != self.generation:
                return
