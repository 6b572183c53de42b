"""Long-lived parts (a consumer, a pool of workers, a flush loop): each start matched by one stop.

:class:`Component` gives a part idempotent ``start()``/``stop()`` and ``async with``, as aiokafka's
consumer and faust's ``mode.Service`` do, so whoever owns it (``run_service``'s exit stack, a test)
needs no flags of its own. A subclass implements :meth:`Component.on_start` and
:meth:`Component.on_stop` and lists their side effects in its docstring.
"""

from __future__ import annotations

import asyncio
from typing import Self


async def cancel_and_wait(*tasks: asyncio.Task | None) -> None:
    """Cancel ``tasks`` (None ones skipped) and wait until every one has ended.

    The one way a part stops its background tasks. A task's own failure is re-raised once all have
    ended (the first one's); a task that ended by its cancellation is not an error. A cancellation of
    the *caller* while it waits still propagates: ``contextlib.suppress(CancelledError)`` around the
    await would swallow it, and the caller would run on as if it had not been cancelled.
    """
    running = [task for task in tasks if task is not None]
    for task in running:
        task.cancel()
    if not running:
        return
    try:
        await asyncio.wait(running)
    except asyncio.CancelledError:
        raise  # the caller was cancelled: the tasks were cancelled too, and end on their own
    for task in running:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()


class Component:
    """A part with idempotent ``start()``/``stop()``; use as ``async with part:``.

    ``start()`` runs :meth:`on_start` once (a second call, or one while starting, waits and
    returns); ``stop()`` runs :meth:`on_stop` once, only if the part started, and a part that
    failed to start is stopped by nobody: ``on_start`` cleans up after itself before raising.
    ``running`` is False from the moment ``stop()`` begins, so work the part refuses while stopping
    can check it from inside ``on_stop``.

    A stopped part may be started again (``on_start`` runs again), as a publisher or an executor is;
    a part that cannot be (a gRPC server) raises ``FailedPrecondition`` from its ``on_start``. A stop
    that takes a setting (a grace period) keeps its ``stop(...)``, stores the setting and calls
    ``super().stop()``; a part whose stop must also reach a loop that is still joining (a consumer's
    ``run()``) sets its own flag before ``super().stop()``, since ``stop()`` waits for a start in progress.
    """

    def __init__(self) -> None:
        self._component_lock = asyncio.Lock()
        self._component_running = False

    @property
    def running(self) -> bool:
        """True between a successful ``start()`` and the next ``stop()``."""
        return self._component_running

    async def on_start(self) -> None:
        """Called by the first ``start()``: connect, spawn, begin background tasks."""

    async def on_stop(self) -> None:
        """Called by the first ``stop()`` after a start: finish what is in hand, release everything."""

    async def start(self) -> None:
        async with self._component_lock:
            if not self._component_running:
                await self.on_start()
                self._component_running = True

    async def stop(self) -> None:
        async with self._component_lock:
            if self._component_running:
                self._component_running = False
                await self.on_stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
