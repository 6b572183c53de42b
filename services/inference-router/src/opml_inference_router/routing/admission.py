"""Per-model concurrency limit with a bounded wait queue: overload is refused, never queued forever.

Each model gets ``limit`` requests in flight (isolation: one hot model cannot take every worker
connection and event-loop slot from the others) and at most ``max_queue`` waiting. A request is
refused with RESOURCE_EXHAUSTED at once when the queue is full, or when its deadline or the model's
SLO (whichever comes first) leaves less time than the expected wait plus the expected service time;
a queued request whose time runs out leaves the queue with the same error. So an admitted request is
served within the SLO, the rest are told at once to back off, and memory stays bounded under any burst.

The limit in force adapts below the configured one (additive increase, multiplicative decrease on the
service time, as TCP's window does on delay): requests in flight beyond what the workers run at once
only queue inside them, where admission can neither price the wait nor shed it, and a machine that
slows down then makes every one of them late. Cutting the limit moves that queue to the router.

Slots held ahead of their calls (the direct data plane's lease, :attr:`ConcurrencyLimiter.lender`) are
passed on to a request that finds none free before it queues: a request waits, and the limit is cut,
only when the requests really in flight fill it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from opml_common.errors import ResourceExhausted

# A queue is standing (the model overloaded) once its oldest waiter has used this share of its budget:
# from then on the newest waiter goes first. A quarter keeps what is served in arrival order well inside
# the SLO even when the service time doubles under CPU pressure before the router's estimate catches up.
STANDING_FRACTION = 0.25
# The share of a request's time (its SLO or deadline) admission keeps for what the router does not see:
# the network both ways, the caller's own event loop, and the lag of the p99 estimate it prices with. An
# admitted request is planned to be answered within the other 90%.
TIME_MARGIN = 0.1
# While requests wait for a slot, one served in more than this share of the SLO (from its slot to its
# answer) cuts the limit in force by BACKOFF, at most once per such service time (the requests then in
# flight were let in under the old limit); one served within it grows the limit by 1/limit, up to the
# configured one. The target is never under twice the fastest recent service time, so a model whose own
# execution takes most of the SLO keeps the concurrency its workers give it.
SERVICE_TARGET_SHARE = 0.25
BACKOFF = 0.9
# The fastest recent service time is the minimum over the last one or two windows of this many answers
# (a machine that got slower for good is seen within two windows).
FASTEST_WINDOW = 256


class Shed(ResourceExhausted):
    """A request refused by admission. ``reason`` is ``queue_full``, ``deadline`` or ``slo`` (a metric label)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ConcurrencyLimiter:
    """Admission for one model: ``try_acquire()`` on the fast path, ``acquire()`` when it says no."""

    def __init__(self, *, limit: int, max_queue: int, name: str = "", slo_s: float | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        """``limit``: the most requests in flight; ``slo_s``: the model's latency objective (p99),
        which bounds each admitted request's wait and which the limit in force adapts to (None: the
        deadline alone bounds the wait, and the limit stays at ``limit``)."""
        _check_limits(limit, max_queue)
        self.name = name
        self.limit = limit
        self.max_queue = max_queue
        self.slo_s = slo_s
        self.allowed = float(limit)  # the limit in force, <= limit
        self.in_flight = 0
        self._waiters: deque[_Waiter] = deque()
        self._clock = clock  # None: the running loop's clock (the one its timers use)
        self._hold_until = float("-inf")  # no cut before then: the last cut's effect is not seen yet
        self._fastest = (float("inf"), float("inf"))  # this window's fastest service time, the last one's
        self._answers = 0  # in this window
        # Slots held for calls that have not arrived (the direct data plane's lease, data_plane/push.py):
        # True when it passed one on to a request that found none free, which then holds it.
        self.lender: Callable[[], bool] | None = None

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def concurrency(self) -> int:
        """Requests let in at once now."""
        return max(1, int(self.allowed))

    def resize(self, *, limit: int, max_queue: int, slo_s: float | None = None) -> None:
        """Apply new limits (a control-plane update); waiters that now fit are let in. A limit in
        force that was not cut follows the new limit; a cut one stays, within it."""
        _check_limits(limit, max_queue)
        self.allowed = float(limit) if self.allowed >= self.limit else min(self.allowed, float(limit))
        self.limit, self.max_queue, self.slo_s = limit, max_queue, slo_s
        self._grant()

    def try_acquire(self) -> bool:
        """Take a slot if one is free and nobody waits (no await, no allocation)."""
        if self.in_flight < self.concurrency and not self._waiters:
            self.in_flight += 1
            return True
        return False

    async def acquire(self, *, time_left_s: float, expected_s: float, tail_s: float | None = None,
                      current_tail: Callable[[], float | None] | None = None) -> None:
        """Wait for a slot, in arrival order.

        ``time_left_s``: until the request's deadline; ``expected_s``: the model's typical (p50)
        service time, which prices each place in the queue; ``tail_s``: its slow (p99) service time,
        what an admitted request must still have left (default ``expected_s``). The request may wait
        until ``min(time_left_s, slo_s) * (1 - TIME_MARGIN) - tail_s`` (``slo_s``: the limiter's). ``current_tail``: the p99 service time as it is when
        the slot comes; a waiter whose time left is then under it is shed rather than served late
        (a burst makes the service time grow while the queue holds waiters priced at the old one).

        Raises:
            Shed: the queue is full (``queue_full``), or the wait would take the request past its
                deadline (``deadline``) or past the SLO (``slo``).
        """
        if self.try_acquire():
            return
        if not self._waiters and self.in_flight <= self.concurrency and self.lender is not None and self.lender():
            return  # a slot held for calls yet to come: queueing behind it would cut the limit for no overload
        if len(self._waiters) >= self.max_queue:
            raise Shed("queue_full", f"model {self.name!r} is at its limit of {self.concurrency} requests in flight "
                                     f"and {self.max_queue} waiting; retry later or with backoff")
        slo_s = self.slo_s
        by_slo = slo_s is not None and slo_s < time_left_s
        reason, limit_s = ("slo", slo_s) if by_slo else ("deadline", time_left_s)
        what = (f"the model's SLO (p99 {limit_s * 1000:.1f} ms)" if by_slo
                else f"its deadline ({limit_s * 1000:.1f} ms left)")
        expected_wait = (len(self._waiters) + 1) / self.concurrency * expected_s
        usable_s = limit_s * (1.0 - TIME_MARGIN)
        budget = usable_s - max(expected_s, tail_s or 0.0)
        if expected_wait > budget:
            raise Shed(reason, f"model {self.name!r} is saturated: the expected wait of {expected_wait * 1000:.1f} ms "
                               f"leaves no time to serve the request within {what}; retry later or with backoff")
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        enqueued = self._now()
        self._waiters.append(_Waiter(waiter, enqueued + budget * STANDING_FRACTION))
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
            raise Shed(reason, f"model {self.name!r}: no slot freed up in time to serve the request within "
                               f"{what}; the model is overloaded")
        tail_now = current_tail() if current_tail is not None else None
        if tail_now is not None and usable_s - (self._now() - enqueued) < tail_now:
            self.release()  # the slot goes on to a waiter with more time left
            raise Shed(reason, f"model {self.name!r}: its service time grew to {tail_now * 1000:.1f} ms (p99) while "
                               f"the request waited, which leaves no time to serve it within {what}; the model is "
                               "overloaded")

    def release(self, service_s: float | None = None) -> None:
        """Give the slot to a waiter, or free it; ``service_s``: how long the request held it, when it
        was answered (the limit in force adapts to it; failures say nothing about queueing).

        In arrival order while the queue drains; once its oldest waiter has used a quarter of its budget
        (a standing queue: the model is overloaded), to the newest waiter, as Facebook's adaptive
        LIFO does: it is served well within the SLO, while the oldest, whose callers have waited
        longest, run out of budget and are shed, instead of everyone being served at the SLO's edge.
        """
        if service_s is not None:
            self._adapt(service_s)
        self.in_flight -= 1
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.in_flight < self.concurrency:
            standing = self._now() >= self._waiters[0].standing_at
            waiter = (self._waiters.pop() if standing else self._waiters.popleft()).future
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(True)

    def _adapt(self, service_s: float) -> None:
        """AIMD on the service time (SERVICE_TARGET_SHARE, BACKOFF)."""
        if self.slo_s is None:
            return
        now_fastest, last_fastest = self._fastest
        self._fastest = (min(now_fastest, service_s), last_fastest)
        self._answers += 1
        if self._answers >= FASTEST_WINDOW:
            self._fastest, self._answers = (float("inf"), self._fastest[0]), 0
        target = max(self.slo_s * SERVICE_TARGET_SHARE, 2.0 * min(self._fastest))
        if service_s <= target:
            self.allowed = min(float(self.limit), self.allowed + 1.0 / self.allowed)
        elif self._waiters and (now := self._now()) >= self._hold_until:
            self.allowed = max(1.0, self.allowed * BACKOFF)
            self._hold_until = now + service_s

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    def _discard(self, waiter: asyncio.Future[bool]) -> None:
        for index, queued in enumerate(self._waiters):
            if queued.future is waiter:
                del self._waiters[index]
                return


def _check_limits(limit: int, max_queue: int) -> None:
    if limit < 1 or max_queue < 0:
        raise ValueError(f"need limit >= 1 and max_queue >= 0, but got limit={limit}, max_queue={max_queue}")


class _Waiter:
    """A queued request: the future its slot is handed over with, and when its wait becomes long
    (``STANDING_FRACTION`` of its budget gone), which tells a standing queue from one that drains."""

    __slots__ = ("future", "standing_at")

    def __init__(self, future: asyncio.Future[bool], standing_at: float) -> None:
        self.future, self.standing_at = future, standing_at


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)
