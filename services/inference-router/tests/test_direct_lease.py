"""The direct data plane's lease against the model's limiter: pure logic, no front, no worker.

The lease holds slots for the front's calls yet to come. A call of the router's path that found every
slot free-but-leased used to queue behind them, and the limiter's AIMD then cut the limit for that
wait on every slow answer (docs/benchmarks.md: 7-46% of the calls shed at 32 callers with the limit
at 64, where the router's path alone sheds none)."""

from __future__ import annotations

import asyncio

import pytest

from opml_inference_router.data_plane.push import _Lease
from opml_inference_router.routing import ConcurrencyLimiter, Shed

SLO_S = 0.05


def _leased(limit: int, held: int) -> tuple[ConcurrencyLimiter, _Lease, list[int]]:
    limiter = ConcurrencyLimiter(limit=limit, max_queue=16, name="m", slo_s=SLO_S)
    assert limiter.try_acquire()
    limiter.release(0.005)  # a fast answer seen: the AIMD's target is a quarter of the SLO
    pushes: list[int] = []
    lease = _Lease(limiter, lambda: pushes.append(lease.held))
    lease.wanted = held
    lease.fit()
    assert lease.held == held
    return limiter, lease, pushes


async def test_a_call_of_the_routers_path_takes_a_leased_slot_instead_of_queueing_behind_the_lease() -> None:
    limiter, lease, pushes = _leased(limit=8, held=6)
    assert limiter.try_acquire() and limiter.try_acquire()  # two calls through the router: the limit is full
    await limiter.acquire(time_left_s=1.0, expected_s=0.005)  # a third: a leased slot, no wait
    assert (lease.held, limiter.in_flight, limiter.waiting) == (5, 8, 0)
    assert pushes == [5]  # the front's table shrinks with the lease
    for _ in range(20):  # the front's answers, slower than a quarter of the SLO: no wait, no cut
        lease.answered(0.04)
    assert limiter.concurrency == 8 and lease.held == 5


async def test_once_the_lease_is_empty_calls_queue_the_limit_is_cut_and_overload_is_shed() -> None:
    """Admission under real overload is the router path's: the lease lends what it holds, then calls
    wait for slots, slow answers cut the limit in force, and what cannot be served in time is shed."""
    limiter, lease, _pushes = _leased(limit=4, held=2)
    assert limiter.try_acquire() and limiter.try_acquire()
    for _ in range(2):
        await limiter.acquire(time_left_s=1.0, expected_s=0.005)
    assert lease.held == 0 and limiter.in_flight == 4
    waiter = asyncio.create_task(limiter.acquire(time_left_s=1.0, expected_s=0.005))
    while limiter.waiting < 1:
        await asyncio.sleep(0)
    limiter.release(0.04)  # slow while a call waits: the limit in force is cut, the slot not handed on
    assert limiter.concurrency == 3 and limiter.waiting == 1 and not waiter.done()
    with pytest.raises(Shed) as shed:  # the queue's expected wait leaves no time within the SLO
        await limiter.acquire(time_left_s=1.0, expected_s=0.04)
    assert shed.value.reason == "slo"
    limiter.release(0.01)
    await waiter
    assert limiter.in_flight == 3


async def test_a_lease_given_back_lends_nothing() -> None:
    limiter, lease, _pushes = _leased(limit=2, held=1)
    lease.give_back()
    assert limiter.lender is None and limiter.in_flight == 0
    assert limiter.try_acquire() and limiter.try_acquire()
    with pytest.raises(Shed):
        await limiter.acquire(time_left_s=0.02, expected_s=0.005)  # no slot frees up: shed at its deadline
