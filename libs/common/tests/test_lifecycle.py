"""cancel_and_wait, the one way a part stops its background tasks; Component, started and stopped once each time."""

from __future__ import annotations

import asyncio

import pytest

from opml_common.lifecycle import Component, cancel_and_wait


async def _forever(started: asyncio.Event) -> None:
    started.set()
    await asyncio.Event().wait()


async def test_every_task_is_cancelled_and_awaited() -> None:
    events = [asyncio.Event() for _ in range(3)]
    tasks = [asyncio.create_task(_forever(event)) for event in events]
    for event in events:
        await event.wait()
    await cancel_and_wait(*tasks, None)
    assert all(task.cancelled() for task in tasks)


async def test_a_task_that_failed_has_its_error_raised_after_all_ended() -> None:
    async def fail() -> None:
        raise ValueError("broken")

    started = asyncio.Event()
    failed = asyncio.create_task(fail())
    other = asyncio.create_task(_forever(started))
    await started.wait()
    await asyncio.wait([failed])
    with pytest.raises(ValueError, match="broken"):
        await cancel_and_wait(failed, other)
    assert other.cancelled()


async def test_a_task_that_finishes_its_cleanup_is_waited_for() -> None:
    cleaned = []
    started = asyncio.Event()

    async def with_cleanup() -> None:
        try:
            await _forever(started)
        finally:
            await asyncio.sleep(0)  # cleanup that itself awaits
            cleaned.append(True)

    task = asyncio.create_task(with_cleanup())
    await started.wait()
    await cancel_and_wait(task)
    assert cleaned == [True]


async def test_the_callers_own_cancellation_propagates() -> None:
    """suppress(CancelledError) around the await swallowed the stopper's own cancellation."""
    inner_started, stopper_waiting = asyncio.Event(), asyncio.Event()
    release = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await _forever(inner_started)
        finally:
            stopper_waiting.set()
            await release.wait()

    inner = asyncio.create_task(slow_to_stop())
    await inner_started.wait()
    stopper = asyncio.create_task(cancel_and_wait(inner))
    await stopper_waiting.wait()
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    release.set()
    await asyncio.wait([inner])


class _Counted(Component):
    def __init__(self, *, fail_start: bool = False) -> None:
        super().__init__()
        self.fail_start, self.starts, self.stops = fail_start, 0, 0

    async def on_start(self) -> None:
        if self.fail_start:
            raise RuntimeError("cannot start")
        self.starts += 1

    async def on_stop(self) -> None:
        self.stops += 1


async def test_a_stopped_component_starts_again() -> None:
    """A publisher or an executor is started again after a stop: on_start runs again."""
    part = _Counted()
    async with part:
        pass
    async with part:
        assert part.running
    assert (part.starts, part.stops, part.running) == (2, 2, False)


async def test_a_component_that_failed_to_start_is_not_stopped() -> None:
    part = _Counted(fail_start=True)
    with pytest.raises(RuntimeError, match="cannot start"):
        await part.start()
    await part.stop()
    assert (part.running, part.stops) == (False, 0)
