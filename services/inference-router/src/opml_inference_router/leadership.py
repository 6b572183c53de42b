"""Router replicas (``OPML_INFERENCE_ROUTER_REPLICATED``): which one writes, and what it runs while it does.

Replicas share Redis and the topics; each runs its own workers and serves inference from them with
the deployments the store holds. The parts that must have one writer run in the replica holding
the ``inference-router`` lease (:class:`~opml_common.lease.LeaderLease`, fenced): the deployment
manager's writes and re-placement (:meth:`DeploymentManager.take_over`), the tenure's ``parts``
(the progressive rollouts' decisions, the autodeploy consumer) and the host registry (the host
agents' calls a follower receives are forwarded to it, :mod:`.leader_calls`, as are the deployment
API's). A follower mirrors the store onto its workers (:meth:`DeploymentManager.follow`).

Taking the lease: the manager catches up with the store and takes over, then the parts start.
Losing it: the parts stop at once, the hosts are let go (they register with the new leader, which
tells them it does not know them), and the manager follows again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from opml_common.bus import EventConsumer
from opml_common.errors import OpmlError
from opml_common.lease import LeaderLease
from opml_common.lifecycle import Component, cancel_and_wait
from opml_common.metrics import ServiceMetrics
from opml_inference_router.control.deployments import DeploymentManager
from opml_inference_router.hosts.registry import HostRegistry

log = logging.getLogger(__name__)

LEASE = "inference-router"
"""The lease whose holder writes the deployments (every replica serves inference)."""
_RETRY_S = 1.0


class ConsumerPart(Component):
    """An event consumer made anew for each tenure (a consumer is not started twice) and run in a task."""

    def __init__(self, make: Callable[[], EventConsumer], name: str) -> None:
        super().__init__()
        self._make, self._name = make, name
        self._consumer: EventConsumer | None = None
        self._task: asyncio.Task | None = None

    async def on_start(self) -> None:
        self._consumer = self._make()
        self._task = asyncio.create_task(self._consumer.run(), name=self._name)
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: the consumer died for the rest of this tenure", self._name, exc_info=task.exception())

    async def on_stop(self) -> None:
        consumer, task = self._consumer, self._task
        self._consumer = self._task = None
        if consumer is not None:
            await consumer.stop()
        await cancel_and_wait(task)


class RouterLeadership(Component):
    """Follows ``lease`` (whose ``on_change`` must call :meth:`changed`), as the module says."""

    def __init__(self, *, lease: LeaderLease, redis: aioredis.Redis, prefix: str, manager: DeploymentManager,
                 hosts: HostRegistry, parts: Sequence[Component], metrics: ServiceMetrics) -> None:
        super().__init__()
        self._lease, self._redis, self._manager, self._hosts = lease, redis, manager, hosts
        self._key = f"{prefix}lease:{LEASE}"  # LeaderLease's key: "{holder}:{token}"
        self._parts = list(parts)
        self._gauge = metrics.gauge("leader", "1 while this router replica holds the inference-router lease: it "
                                    "writes the deployments, drives rollouts, autodeploys and places on hosts; else 0.")
        self._gauge.set(0)
        self._transitions: asyncio.Queue[bool] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self.leads = False  # the manager took over and the parts run

    def changed(self, leading: bool) -> None:
        """The lease's ``on_change`` (called in the lease's task; acted on in this one's, in order)."""
        if not leading:
            self.leads = False  # at once: the API forwards from now on
            self._gauge.set(0)
        self._transitions.put_nowait(leading)

    def leading(self) -> bool:
        """Whether this replica serves the control plane itself now."""
        return self.leads and self._lease.leading

    async def leader(self) -> str | None:
        """The gRPC address of the replica holding the lease (None when none does, or Redis is away)."""
        try:
            value = await self._redis.get(self._key)
        except RedisError:
            return None
        if value is None:
            return None
        holder = (value.decode() if isinstance(value, bytes) else value).rsplit(":", 1)[0]
        return holder or None

    async def on_start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="router-leadership")

    async def on_stop(self) -> None:
        """Ends the tenure's parts (before the lease is released: no successor overlaps them)."""
        await cancel_and_wait(self._task)
        self._task = None
        self.leads = False
        self._gauge.set(0)
        await self._stop_parts()

    async def _follow(self) -> None:
        leading = False
        while True:
            if leading and not self.leads:  # taking over failed (Redis away): try again while leading
                try:
                    leading = await asyncio.wait_for(self._transitions.get(), _RETRY_S)
                except TimeoutError:
                    await self._begin()
                    continue
            else:
                leading = await self._transitions.get()
            if leading and not self.leads:
                await self._begin()
            elif not leading and (self.leads or self._manager.leading):
                await self._end()

    async def _begin(self) -> None:
        log.info("inference-router: this replica leads (lease %s); taking the control plane over", self._lease.holder)
        try:
            await self._manager.take_over()
            for part in self._parts:
                await part.start()
        except (OpmlError, RedisError, OSError) as error:
            log.warning("inference-router: taking over failed (%s); trying again while leading", error)
            await self._end()
            return
        if self._lease.leading:
            self.leads = True
            self._gauge.set(1)

    async def _stop_parts(self) -> None:
        for part in reversed(self._parts):
            try:
                await part.stop()
            except Exception:  # noqa: BLE001 - every part is stopped whatever one does
                log.exception("stopping %s at the end of a tenure failed", type(part).__name__)

    async def _end(self) -> None:
        self.leads = False
        self._gauge.set(0)
        await self._stop_parts()
        if self._manager.leading:
            log.warning("inference-router: this replica no longer leads; it follows the deployments and lets "
                        "its hosts go (they register with the next leader)")
        await self._hosts.clear()
        await self._manager.step_down()
