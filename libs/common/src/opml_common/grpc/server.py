"""gRPC server bootstrap on grpc.aio: health, reflection, interceptors, /metrics, graceful stop."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from opml_common.config import GrpcTlsSettings, PlatformSettings, ServiceSettings
from opml_common.errors import FailedPrecondition
from opml_common.grpc.interceptors import ROLE_RANK, AuthInterceptor, ObservabilityInterceptor, TokenVerifier
from opml_common.lifecycle import Component
from opml_common.metrics import ServiceMetrics, serve_metrics

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""The platform's gRPC message cap (receive and send), unless a service's settings lower its receive cap."""


@dataclass(frozen=True)
class ServiceRegistration:
    """One servicer to host: its proto service, the generated ``add_*_to_server`` function, and the
    role each of its RPCs needs.

    ``method_roles`` must name every RPC of ``service`` and nothing else: an RPC left out would
    silently need the default role, a misspelt one would protect nothing, so either stops the
    service at start-up with a message naming it.

    ``token_verifier``: the scoped bearer tokens the service issues itself (see
    :class:`~opml_common.grpc.interceptors.AuthInterceptor`); at most one registration of a server
    brings one.

    Raises:
        ValueError: ``method_roles`` misses an RPC, names one ``service`` does not have, or uses an
            unknown role.
    """

    service: ServiceDescriptor
    add_to_server: Callable[[object, grpc.aio.Server], None]
    servicer: object
    method_roles: Mapping[str, str]
    token_verifier: TokenVerifier | None = None

    def __post_init__(self) -> None:
        methods = {method.name for method in self.service.methods}
        missing = sorted(methods - set(self.method_roles))
        unknown = sorted(set(self.method_roles) - methods)
        bad_roles = sorted({f"{m}={r}" for m, r in self.method_roles.items() if r not in ROLE_RANK})
        problems = [f"no role for {', '.join(missing)}" if missing else "",
                    f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not an RPC of it" if unknown else "",
                    f"unknown roles {', '.join(bad_roles)} (roles: {', '.join(ROLE_RANK)})" if bad_roles else ""]
        if any(problems):
            raise ValueError(f"method_roles of {self.service.full_name}: " + "; ".join(filter(None, problems))
                             + f". Every RPC must name the role it needs (one of {', '.join(ROLE_RANK)}).")

    @property
    def full_name(self) -> str:
        return self.service.full_name

    def full_method_roles(self) -> dict[str, str]:
        """``/package.Service/Method`` -> role, as the auth interceptor looks calls up."""
        return {f"/{self.full_name}/{method}": role for method, role in self.method_roles.items()}


class GrpcServer(Component):
    """A service's gRPC server and its /metrics endpoint.

    ``start()`` binds the ports (0 = pick free), registers the servicers, the standard health
    service (SERVING once started) and server reflection. ``stop()`` marks health NOT_SERVING,
    lets in-flight RPCs finish within ``settings.shutdown_grace_s``, then stops. Both are idempotent;
    a stopped server is not started again (grpc.aio cannot): ``start()`` then raises FailedPrecondition.

    With ``OPML_GRPC_TLS_CERT``/``_KEY`` set the port speaks TLS only (a plaintext client fails its
    handshake); with ``OPML_GRPC_TLS_CLIENT_CA`` as well, a client must present a certificate that CA
    signed (mTLS). The Unix-socket data plane of a worker (:mod:`opml_inference_router.worker.uds`) is
    not gRPC and is guarded by file mode and peer credentials instead.

    ``max_receive_message_bytes``: the largest request message the server accepts (gRPC refuses a
    longer one with RESOURCE_EXHAUSTED before any servicer runs); default: the service settings'
    ``grpc_max_receive_bytes`` where its settings class declares one, else :data:`MAX_MESSAGE_BYTES`.
    """

    def __init__(self, *, settings: ServiceSettings, platform: PlatformSettings, metrics: ServiceMetrics,
                 registrations: Sequence[ServiceRegistration], max_receive_message_bytes: int | None = None) -> None:
        super().__init__()
        self.settings = settings
        self.metrics = metrics
        self._registrations = registrations
        self._health = health.aio.HealthServicer()
        tokens = platform.tokens()
        if not tokens:
            log.warning("no OPML_AUTH_TOKENS set: every caller is an anonymous admin (dev only)")
        observability = ObservabilityInterceptor(metrics)
        observability.declare(method for r in registrations for method in r.full_method_roles())
        if max_receive_message_bytes is None:
            max_receive_message_bytes = getattr(settings, "grpc_max_receive_bytes", None) or MAX_MESSAGE_BYTES
        self.max_receive_message_bytes = max_receive_message_bytes
        verifiers = [r.token_verifier for r in registrations if r.token_verifier is not None]
        if len(verifiers) > 1:
            raise ValueError("at most one registration of a server may bring a token verifier")
        self._server = grpc.aio.server(
            interceptors=[observability, AuthInterceptor(
                tokens, method_roles={k: v for r in registrations for k, v in r.full_method_roles().items()},
                token_verifier=verifiers[0] if verifiers else None)],
            # so_reuseport off: a port another process listens on is a bind error, not a port two
            # servers share (the kernel would then split the calls between them).
            options=[("grpc.max_receive_message_length", max_receive_message_bytes),
                     ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                     ("grpc.so_reuseport", 0)],
        )
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._tls = platform if isinstance(platform, GrpcTlsSettings) else None

    async def on_start(self) -> None:
        if self.port is not None:
            raise FailedPrecondition("a GrpcServer started once cannot be started again (grpc.aio cannot): "
                                     "make a new one")
        for registration in self._registrations:
            registration.add_to_server(registration.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        names = [r.full_name for r in self._registrations]
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self._server)
        address = f"{self.settings.host}:{self.settings.grpc_port}"
        credentials = server_credentials(self._tls) if self._tls is not None else None
        self.port = (self._server.add_secure_port(address, credentials) if credentials is not None
                     else self._server.add_insecure_port(address))
        await self._server.start()
        try:
            self.metrics_port = serve_metrics(self.settings.host, self.settings.metrics_port, self.metrics.registry)
            for name in ("", *names):
                await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        except BaseException:  # not started: nobody calls stop(), so the bound port is released here
            await self._server.stop(None)
            raise
        log.info("serving", extra={"grpc": f"{self.settings.host}:{self.port}",
                                   "tls": "mtls" if self._tls and self._tls.grpc_tls_client_ca else
                                   "tls" if credentials is not None else "off",
                                   "metrics": f"http://{self.settings.host}:{self.metrics_port}/metrics"})

    async def on_stop(self) -> None:
        await self._health.enter_graceful_shutdown()
        await self._server.stop(self.settings.shutdown_grace_s)


def server_credentials(tls: GrpcTlsSettings) -> grpc.ServerCredentials | None:
    """TLS credentials for a server from ``OPML_GRPC_TLS_CERT``/``_KEY`` (and ``_CLIENT_CA``: mTLS),
    or None when no certificate is set (plaintext)."""
    if tls.grpc_tls_cert is None or tls.grpc_tls_key is None:
        return None
    client_ca = tls.grpc_tls_client_ca.read_bytes() if tls.grpc_tls_client_ca is not None else None
    return grpc.ssl_server_credentials([(tls.grpc_tls_key.read_bytes(), tls.grpc_tls_cert.read_bytes())],
                                       root_certificates=client_ca, require_client_auth=client_ca is not None)


async def wait_for_signal() -> None:
    """Return when the process gets SIGINT or SIGTERM (the stack and Kubernetes stop us so)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
