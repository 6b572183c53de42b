"""A replica reached over gRPC: one grpc.aio channel to a worker's GRPCInferenceService.

Calls pass KServe v2 messages as bytes both ways (no serializer), so the router never decodes or
re-encodes tensors. Status codes become :class:`ReplicaFailed` with the retry decision of
:meth:`.errors.ReplicaFailed.of_status` (shared with :mod:`.uds_replica`, the cheaper hop to workers
on this machine, and :mod:`.local_replica`).
"""

from __future__ import annotations

import grpc

from opml_common.grpc.client import Tls, open_aio_channel
from opml_inference_router.routing.errors import ReplicaFailed
from opml_inference_router.routing.replicas import Replica

SERVICE = "inference.GRPCInferenceService"
_CALLS = ("ModelInfer", "ModelMetadata", "ModelReady")
_MAX_MESSAGE = 64 * 1024 * 1024


class GrpcReplica(Replica):
    """A worker at ``address`` (host:port). The channel connects lazily and reconnects by itself.

    ``token``: the bearer token the router presents to workers that require auth (production);
    bind it with ``functools.partial(GrpcReplica, token=...)`` as the router's ``connect``.
    ``tls``: TLS on the hop (default: ``OPML_GRPC_TLS_*``, as the workers the router starts inherit;
    a worker on another host needs it, one on this machine is better reached over its Unix socket).
    """

    def __init__(self, address: str, *, token: str | None = None, tls: Tls = None) -> None:
        self.name = address
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._channel = open_aio_channel(address, tls=tls, options=[
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            ("grpc.max_send_message_length", _MAX_MESSAGE),
            # Find a dead worker fast even when it cannot send a FIN (host gone).
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # Reconnect soon after a restart instead of backing off for tens of seconds.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2_000),
        ])
        # No (de)serializer: the call takes and returns the wire bytes themselves.
        self._calls = {method: self._channel.unary_unary(f"/{SERVICE}/{method}") for method in _CALLS}

    async def call(self, method: str, request: bytes, *, timeout_s: float) -> bytes:
        try:
            return await self._calls[method](request, timeout=timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise ReplicaFailed.of_status(exc.code().name, exc.details(), replica=self.name) from None

    async def close(self) -> None:
        await self._channel.close()
