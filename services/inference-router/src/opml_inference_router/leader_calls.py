"""A follower's control-plane calls, forwarded to the leading router replica.

Every router replica serves inference; the DeploymentService and the HostService change (or read)
what only the holder of the ``inference-router`` lease keeps: the deployments it writes, the rollouts
it drives, the hosts it places on. :class:`LeaderCalls` wraps such a servicer: on the leader each
call runs here; on a follower it is sent, as it came (the same request, the caller's own
``authorization``, what is left of its deadline), to the leader's gRPC address, which the lease's
holder names, and the leader's answer or error goes back unchanged. So a client or a host agent
may call any replica (a Kubernetes Service picks one), and the leader checks the caller's rights
itself. No leader (the lease free, between a leader's death and its successor's take-over):
UNAVAILABLE saying so, which the platform's clients retry.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from opml_common.errors import Unavailable
from opml_common.grpc.client import domain_error, open_aio_channel

log = logging.getLogger(__name__)

_FORWARDED_METADATA = ("authorization", "traceparent", "tracestate")  # the caller's rights, its trace


class LeaderCalls:
    """``servicer`` with each RPC of ``methods`` served by the leader (see the module).

    ``leading()``: whether this replica leads now; ``leader()``: the leading replica's gRPC address
    (None when none leads); ``me``: this replica's own address (the lease it held before a restart
    may still name it); ``stub``: the service's generated stub class."""

    def __init__(self, servicer: Any, stub: Callable[[grpc.aio.Channel], Any], methods: frozenset[str], *,
                 leading: Callable[[], bool], leader: Callable[[], Awaitable[str | None]], me: str) -> None:
        self._servicer, self._stub, self._methods = servicer, stub, methods
        self._leading, self._leader, self._me = leading, leader, me
        self._channel: tuple[str, grpc.aio.Channel] | None = None
        self._closing: set[asyncio.Task] = set()

    def __getattr__(self, name: str) -> Any:
        handler = getattr(self._servicer, name)
        if name not in self._methods:
            return handler

        async def served_by_the_leader(request, context: grpc.aio.ServicerContext):
            if self._leading():
                return await handler(request, context)
            return await self._forward(name, request, context)

        return served_by_the_leader

    async def _forward(self, name: str, request, context: grpc.aio.ServicerContext):
        """Raises: Unavailable (no replica leads now, or it cannot be reached); the leader's own error."""
        target = await self._leader()
        if target is None or target == self._me:
            raise Unavailable(f"{name}: no inference-router replica leads now (a new leader takes over within the "
                              f"lease's time to live); try again")
        metadata = tuple((key, value) for key, value in (context.invocation_metadata() or ())
                         if key in _FORWARDED_METADATA)
        try:
            return await getattr(self._stub(self._channel_to(target)), name)(
                request, metadata=metadata, timeout=context.time_remaining())
        except grpc.aio.AioRpcError as error:
            raise domain_error(error) from None

    def _channel_to(self, target: str) -> grpc.aio.Channel:
        if self._channel is None or self._channel[0] != target:
            if self._channel is not None:  # the old leader's: closed once its calls end
                closing = asyncio.get_running_loop().create_task(self._channel[1].close(grace=30))
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
            log.info("control-plane calls go to the leading replica at %s", target)
            self._channel = (target, open_aio_channel(target))
        return self._channel[1]

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel[1].close()
            self._channel = None
