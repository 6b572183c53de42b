"""gRPC server bootstrap on grpc.aio: health, reflection, interceptors, /metrics, graceful stop."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from opml_common.config import PlatformSettings, ServiceSettings
from opml_common.grpc.interceptors import AuthInterceptor, ObservabilityInterceptor
from opml_common.metrics import ServiceMetrics, serve_metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceRegistration:
    """One servicer to host: its full proto name and the generated ``add_*_to_server`` function."""

    full_name: str
    add_to_server: Callable[[object, grpc.aio.Server], None]
    servicer: object


class GrpcServer:
    """A service's gRPC server and its /metrics endpoint.

    ``start()`` binds the ports (0 = pick free), registers the servicers, the standard health
    service (SERVING once started) and server reflection. ``stop()`` marks health NOT_SERVING,
    lets in-flight RPCs finish within ``settings.shutdown_grace_s``, then stops. Both are idempotent.
    """

    def __init__(self, *, settings: ServiceSettings, platform: PlatformSettings, metrics: ServiceMetrics,
                 registrations: Sequence[ServiceRegistration], method_roles: Mapping[str, str]) -> None:
        self.settings = settings
        self.metrics = metrics
        self._registrations = registrations
        self._health = health.aio.HealthServicer()
        tokens = platform.tokens()
        if not tokens:
            log.warning("no OPML_AUTH_TOKENS set: every caller is an anonymous admin (dev only)")
        self._server = grpc.aio.server(
            interceptors=[ObservabilityInterceptor(metrics), AuthInterceptor(tokens, method_roles=method_roles)],
            options=[("grpc.max_receive_message_length", 64 * 1024 * 1024),
                     ("grpc.max_send_message_length", 64 * 1024 * 1024)],
        )
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._stopped = False

    async def start(self) -> None:
        if self.port is not None:
            return
        for registration in self._registrations:
            registration.add_to_server(registration.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        names = [r.full_name for r in self._registrations]
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self._server)
        self.port = self._server.add_insecure_port(f"{self.settings.host}:{self.settings.grpc_port}")
        await self._server.start()
        self.metrics_port = serve_metrics(self.settings.host, self.settings.metrics_port, self.metrics.registry)
        for name in ("", *names):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", extra={"grpc": f"{self.settings.host}:{self.port}",
                                   "metrics": f"http://{self.settings.host}:{self.metrics_port}/metrics"})

    async def stop(self) -> None:
        if self._stopped or self.port is None:
            return
        self._stopped = True
        await self._health.enter_graceful_shutdown()
        await self._server.stop(self.settings.shutdown_grace_s)

    async def __aenter__(self) -> "GrpcServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def wait_for_signal() -> None:
    """Return when the process gets SIGINT or SIGTERM (the stack and Kubernetes stop us so)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
