"""Replicas on a host that can be severed: when the host is lost, the calls in flight to it fail at once.

A host cut off from the router does not close its connections: calls to its workers hang until
their deadlines, and marking its replicas down only keeps new requests away. Severing fails the
hanging calls with a retriable UNAVAILABLE, so the router retries each on another replica while the
request's deadline still allows (a backup request covers only a share of requests). Once the host
heartbeats again its replicas are whole again. Each carries its worker's site, so the router chooses
the nearest replica (:meth:`~opml_inference_router.routing.ReplicaSet.pick`).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable

from opml_inference_router.routing import Replica
from opml_inference_router.routing.errors import ReplicaFailed


class SeverableReplica(Replica):
    """A host worker's replica (wrapping the router's own transport) whose calls :meth:`sever` fails."""

    def __init__(self, inner: Replica, site: str) -> None:
        self.inner = inner
        self.name = inner.name
        self.site = site
        self._severed: asyncio.Future[str] | None = None
        self._reason = ""

    async def call(self, method: str, request: bytes, *, timeout_s: float) -> bytes:
        if self._reason:
            raise ReplicaFailed("UNAVAILABLE", self._reason, retriable=True, eject=True, replica=self.name)
        if self._severed is None:
            self._severed = asyncio.get_running_loop().create_future()
        severed = self._severed
        call = asyncio.ensure_future(self.inner.call(method, request, timeout_s=timeout_s))
        try:
            await asyncio.wait((call, severed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not call.done():
                call.cancel()  # severed, or the router cancelled us (a backup won): the worker drops it
        if severed.done() and not call.done():
            raise ReplicaFailed("UNAVAILABLE", severed.result(), retriable=True, eject=True, replica=self.name)
        if call.cancelled():  # ended under the transport's own feet (its channel closed): another may answer
            raise ReplicaFailed("CANCELLED", "the call to the worker was cancelled", retriable=True, eject=False,
                                replica=self.name)
        return call.result()  # the answer, or the transport's ReplicaFailed

    def sever(self, reason: str) -> None:
        """Fails the calls in flight and every call until :meth:`mend`."""
        self._reason = reason
        if self._severed is not None and not self._severed.done():
            self._severed.set_result(reason)
        self._severed = None

    def mend(self) -> None:
        self._reason = ""

    async def close(self) -> None:
        await self.inner.close()


class HostReplicas:
    """The severable replicas the router made for each host worker address."""

    def __init__(self) -> None:
        self._by_address: dict[str, weakref.WeakSet[SeverableReplica]] = {}

    def connector(self, connect: Callable[[str], Replica],
                  site_of: Callable[[str], str | None]) -> Callable[[str], Replica]:
        """The router's ``connect``: ``connect``'s replica, made severable and placed at its site for an
        address ``site_of`` says is a host worker's (None: the router's own worker)."""
        def make(address: str) -> Replica:
            replica = connect(address)
            site = site_of(address)
            if site is None:
                return replica
            severable = SeverableReplica(replica, site)
            self._by_address.setdefault(address, weakref.WeakSet()).add(severable)
            return severable
        return make

    def sever(self, address: str, reason: str) -> int:
        replicas = list(self._by_address.get(address, ()))
        for replica in replicas:
            replica.sever(reason)
        return len(replicas)

    def mend(self, address: str) -> None:
        for replica in list(self._by_address.get(address, ())):
            replica.mend()
