"""A leader lease in Redis with fencing: the parts of a service that must have one writer (placement,
scheduling, autodeploy, a controller's reconcile loop) run in the replica that holds it.

A lease is the key ``{prefix}lease:{name}`` holding ``{holder}:{token}`` with a TTL; the token comes
from ``{prefix}lease:{name}:fence``, incremented at each acquisition, so each tenure has a larger
token than every one before it. Holding is judged on the holder's own monotonic clock: a replica
stops acting as leader ``ttl - margin`` after its last successful renewal even when Redis cannot be
reached (it cannot know whether another replica took over), and Redis lets the key expire ``ttl``
after that renewal, so two replicas never both believe they lead while clocks run at the same rate.

Belief is not enough when a leader stalls (a GC pause, a SIGSTOP) past its lease and then writes:
:meth:`LeaderLease.fenced` runs a Redis transaction that commits only while the fence still holds
this tenure's token (WATCH on the fence key), so a deposed leader's late write is refused rather
than applied over its successor's. Stores a leader writes to take their writes through it, or check
:attr:`LeaderLease.fence` inside their own Lua script (one round trip, with their own conditions).

Every Redis call of the lease is bounded by the time its tenure has left: a Redis that stops
answering (a partition, a stalled server) without closing the connection cannot hold the lease's
task past the end of the tenure, so ``on_change(False)`` comes when the tenure ends, not when the
connection finally breaks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError

from opml_common.errors import FailedPrecondition
from opml_common.lifecycle import Component, cancel_and_wait

log = logging.getLogger(__name__)

_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. token, 'PX', ARGV[2])
return token
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class NotLeader(FailedPrecondition):
    """This replica does not hold the lease (any more): the write was not made."""


@dataclass(frozen=True, slots=True)
class Fence:
    """A tenure's fence, for a store's own Lua script: write only while ``GET key`` is ``token``."""

    key: str
    token: int


class LeaderLease(Component):
    """Holds the lease ``name`` for ``holder`` whenever it is free, renewing it every ``ttl_s / 3``.

    ``on_change(leading)`` is called (in the lease's task) when this replica becomes or stops being
    the leader; :meth:`wait_leading` waits for the former. Stopping releases the lease at once, so a
    replica shut down cleanly hands over without its successor waiting out the TTL.
    """

    def __init__(self, redis: aioredis.Redis, name: str, holder: str, *, prefix: str = "", ttl_s: float = 10.0,
                 on_change: Callable[[bool], None] | None = None) -> None:
        super().__init__()
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, but got {ttl_s}")
        self._redis, self.name, self.holder = redis, name, holder
        self._key, self._fence = f"{prefix}lease:{name}", f"{prefix}lease:{name}:fence"
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._margin_s = ttl_s / 5  # acted on as lost this long before Redis would expire it
        self._interval_s = ttl_s / 3
        self._on_change = on_change
        self._token: int | None = None
        self._valid_until = 0.0  # monotonic
        self._leading = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    @property
    def leading(self) -> bool:
        """Whether this replica holds the lease now, on its own clock."""
        return self._token is not None and time.monotonic() < self._valid_until

    @property
    def token(self) -> int:
        """This tenure's fencing token.

        Raises: NotLeader: not leading."""
        if not self.leading:
            raise NotLeader(f"{self.holder} does not hold the {self.name} lease")
        return self._token  # type: ignore[return-value]

    @property
    def fence(self) -> Fence:
        """This tenure's fence, for a check inside a store's own script.

        Raises: NotLeader: not leading."""
        return Fence(self._fence, self.token)

    async def wait_leading(self) -> None:
        await self._leading.wait()

    @asynccontextmanager
    async def fenced(self) -> AsyncIterator[aioredis.client.Pipeline]:
        """A transaction that commits only if this tenure still holds the fence::

            async with lease.fenced() as pipe:
                pipe.hset(...)

        Commands queued on ``pipe`` run atomically on exit, or not at all.

        Raises: NotLeader: not leading, or another replica took the lease before the commit."""
        token = self.token
        async with self._redis.pipeline(transaction=True) as pipe:
            await pipe.watch(self._fence)
            current = await pipe.get(self._fence)
            if current is None or int(current) != token:
                raise NotLeader(f"the {self.name} lease moved on (fence {int(current or 0)}, this tenure {token})")
            pipe.multi()
            yield pipe
            try:
                await pipe.execute()
            except WatchError:
                raise NotLeader(f"the {self.name} lease was taken while {self.holder} was writing") from None

    async def on_start(self) -> None:
        self._task = asyncio.create_task(self._hold(), name=f"lease-{self.name}")

    async def on_stop(self) -> None:
        """Stops renewing and releases the lease if held (another replica may take it at once)."""
        await cancel_and_wait(self._task)
        self._task = None
        if self._token is not None:
            value = f"{self.holder}:{self._token}"
            self._set(None)
            try:
                await self._release(keys=[self._key], args=[value])
            except RedisError as error:  # it expires by itself
                log.warning("lease %s: not released (%s); it expires in at most its TTL", self.name, error)

    async def _hold(self) -> None:
        while True:
            started = time.monotonic()
            # A call that outlives the tenure is abandoned: a renewal that late keeps nothing.
            bound = self._valid_until - started if self._token is not None else self._interval_s
            try:
                if self._token is None:
                    token = int(await asyncio.wait_for(
                        self._acquire(keys=[self._key, self._fence], args=[self.holder, self._ttl_ms]), bound))
                    if token:
                        self._valid_until = started + self._ttl_ms / 1000 - self._margin_s
                        self._set(token)
                elif bound > 0 and await asyncio.wait_for(
                        self._renew(keys=[self._key], args=[f"{self.holder}:{self._token}", self._ttl_ms]), bound):
                    self._valid_until = started + self._ttl_ms / 1000 - self._margin_s
                elif bound > 0:
                    log.warning("lease %s: lost by %s (token %d)", self.name, self.holder, self._token)
                    self._set(None)
                    continue  # try to take it again at once: it may be free
            except (RedisError, TimeoutError) as error:
                log.warning("lease %s: Redis unreachable (%s)", self.name, str(error) or "no answer in time")
            if self._token is not None and not self.leading:
                log.warning("lease %s: %s could not renew in time; no longer leading", self.name, self.holder)
                self._set(None)
            await asyncio.sleep(self._interval_s)

    def _set(self, token: int | None) -> None:
        was = self._token is not None
        self._token = token
        if token is None:
            self._leading.clear()
        else:
            self._leading.set()
            log.info("lease %s: held by %s (token %d)", self.name, self.holder, token)
        if was != (token is not None) and self._on_change is not None:
            try:
                self._on_change(token is not None)
            except Exception:  # the holder's bug must not stop the lease's renewals
                log.exception("lease %s: on_change failed", self.name)
