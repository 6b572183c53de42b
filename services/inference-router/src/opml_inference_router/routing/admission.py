"""Per-model concurrency limit with a bounded wait queue: overload is refused, never queued forever.

Each model gets ``limit`` requests in flight (isolation: one hot model cannot take every worker
connection and event-loop slot from the others) and at most ``max_queue`` waiting. A request is
refused with RESOURCE_EXHAUSTED at once when the queue is full, or when its deadline leaves less
time than the expected wait plus the expected service time; a queued request whose deadline
comes too close leaves the queue with the same error. Memory stays bounded under any burst.
"""

from __future__ import annotations

import asyncio
from collections import deque

from opml_common.errors import ResourceExhausted


class Shed(ResourceExhausted):
    """A request refused by admission. ``reason`` is ``queue_full`` or ``deadline`` (a metric label)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ConcurrencyLimiter:
    """Admission for one model: ``try_acquire()`` on the fast path, ``acquire()`` when it says no."""

    def __init__(self, *, limit: int, max_queue: int, name: str = "") -> None:
        if limit < 1 or max_queue < 0:
            raise ValueError(f"need limit >= 1 and max_queue >= 0, but got limit={limit}, max_queue={max_queue}")
        self.name = name
        self.limit = limit
        self.max_queue = max_queue
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[bool]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def resize(self, *, limit: int, max_queue: int) -> None:
        """Apply new limits (a control-plane update); waiters that now fit are let in."""
        if limit < 1 or max_queue < 0:
            raise ValueError(f"need limit >= 1 and max_queue >= 0, but got limit={limit}, max_queue={max_queue}")
        self.limit, self.max_queue = limit, max_queue
        while self._waiters and self.in_flight < self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(True)

    def try_acquire(self) -> bool:
        """Take a slot if one is free and nobody waits (no await, no allocation)."""
        if self.in_flight < self.limit and not self._waiters:
            self.in_flight += 1
            return True
        return False

    async def acquire(self, *, time_left_s: float, expected_s: float) -> None:
        """Wait for a slot, in arrival order.

        ``time_left_s``: until the request's deadline; ``expected_s``: the model's typical service
        time. The request may wait until ``time_left_s - expected_s``.

        Raises:
            Shed: the queue is full (``queue_full``), or the deadline cannot be met (``deadline``).
        """
        if self.try_acquire():
            return
        if len(self._waiters) >= self.max_queue:
            raise Shed("queue_full", f"model {self.name!r} is at its limit of {self.limit} requests in flight "
                                     f"and {self.max_queue} waiting; retry later or with backoff")
        expected_wait = (len(self._waiters) + 1) / self.limit * expected_s
        budget = time_left_s - expected_s
        if expected_wait > budget:
            raise Shed("deadline", f"model {self.name!r} is saturated: the expected wait of "
                                   f"{expected_wait * 1000:.1f} ms leaves no time to serve the request "
                                   f"within its deadline ({time_left_s * 1000:.1f} ms left)")
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._waiters.append(waiter)
        timer = loop.call_later(budget, _expire, waiter)
        try:
            granted = await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self.release()  # the slot was handed over just as the caller went away
            else:
                waiter.cancel()
                self._discard(waiter)
            raise
        finally:
            timer.cancel()
        if not granted:
            self._discard(waiter)
            raise Shed("deadline", f"model {self.name!r}: no slot freed up in time to serve the request within "
                                   f"its deadline ({time_left_s * 1000:.1f} ms); the model is overloaded")

    def release(self) -> None:
        """Give the slot to the longest waiter, or free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(True)
                return
        self.in_flight -= 1

    def _discard(self, waiter: asyncio.Future[bool]) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)
