"""The router's inference port: the native gRPC front (``native/front.cc``) and the link it calls the router on.

Why a native front: on the router's Python gRPC server a call costs ~300 µs of CPU before any routing
(grpc.aio's floor, docs/benchmarks.md), most of what the router adds per request. The C++ front
takes KServe v2 ``GRPCInferenceService`` calls (ModelInfer, ModelMetadata, ModelReady, ServerLive,
ServerReady, ServerMetadata) off the wire and hands each to the router as a frame (:mod:`.frames`)
over one socket pair; the router answers them here with the same code as its Python server
(:class:`~.frontend.InferenceFrontend`), so routing, admission, hedging, the prediction log and the
metrics stay in one place. Everything else (DeploymentService, health and reflection of the router
itself, Triton's repository and statistics extensions) stays on the router's gRPC port, which also
still serves inference.

Auth is the router's: the front passes each call's ``authorization`` header, checked here against
``OPML_AUTH_TOKENS`` with the roles of :data:`~.kserve.roles.INFERENCE_METHOD_ROLES`. With the direct
data plane (:mod:`.data_plane`, ``OPML_INFERENCE_ROUTER_DIRECT_DATA_PLANE``) the front sends ModelInfer
calls of the models it has a route for straight to a worker, and a credential's calls after the router
let its first one through. TLS: the
front serves TLS (and mTLS) from the same ``OPML_GRPC_TLS_*`` files as the router's port.

Lifetime: :class:`NativeFront` starts the binary, restarts it (on the same port) when it exits while
the router runs, and stops it (SIGTERM: health NOT_SERVING, calls in flight finish within the grace
period) before the router drains. The front exits by itself when the link closes (the router died).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from pathlib import Path

from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from opml_common.config import GrpcTlsSettings, TokenGrant
from opml_common.errors import FailedPrecondition, InvalidArgument, OpmlError
from opml_common.grpc.interceptors import UNAUTHENTICATED_MESSAGE, Principal, bearer_principal, missing_role_message
from opml_common.lifecycle import Component, cancel_and_wait
from opml_common.metrics import ServiceMetrics
from opml_common.retry import Backoff
from opml_inference_router.data_plane import DirectPlane
from opml_inference_router.frames import (
    CODE_NUMBERS,
    KINDS,
    METHODS,
    CallCounter,
    FrameServerConnection,
    as_status,
)
from opml_inference_router.frontend import InferenceFrontend
from opml_inference_router.kserve.roles import INFERENCE_METHOD_ROLES
from opml_inference_router.routing import wire

log = logging.getLogger(__name__)

BINARY_NAME = "opml-inference-front"
DEFAULT_BINARY = Path(sys.prefix) / "bin" / BINARY_NAME
"""Where ``make install`` builds it: the virtual environment's bin."""

_RESTARTS = Backoff(base_s=0.2, max_s=10.0)
_INFER = KINDS["ModelInfer"]
_MAX_CACHED_CREDENTIALS = 1024


class FrontLink:
    """The router's side of the link: a call frame in, the frontend's answer out (a FrameService).

    ``tokens``: the platform's bearer tokens (none: every caller is an anonymous admin, dev only);
    ``plane``: the direct data plane, if on (its pushes go out on this link, its reports come in).
    Metrics: ``opml_inference_router_front_requests_total{method,code}`` (the direct path's calls too)."""

    def __init__(self, frontend: InferenceFrontend, *, tokens: Mapping[str, TokenGrant],
                 metrics: ServiceMetrics, plane: DirectPlane | None = None) -> None:
        self._tokens = dict(tokens)
        self._plane = plane
        self._principals: dict[bytes, Principal | None] = {}
        self._handlers: dict[int, Callable[[bytes, float | None], Awaitable[bytes]]] = {
            KINDS["ModelInfer"]: frontend.infer,
            KINDS["ModelMetadata"]: partial(_model_metadata, frontend),
            KINDS["ModelReady"]: _typed(frontend.ModelReady, pb.ModelReadyRequest),
            KINDS["ServerLive"]: _typed(frontend.ServerLive, pb.ServerLiveRequest),
            KINDS["ServerReady"]: _typed(frontend.ServerReady, pb.ServerReadyRequest),
            KINDS["ServerMetadata"]: _typed(frontend.ServerMetadata, pb.ServerMetadataRequest),
        }
        self._needed = {kind: INFERENCE_METHOD_ROLES[METHODS[kind]] for kind in self._handlers}
        self.count = CallCounter(metrics, "front_requests_total", "Calls the native inference front served, "
                                 "by method and status code (through the router or sent straight to a worker).",
                                 self._handlers).count
        if plane is not None:
            plane.count = self.count

    def attached(self, connection: FrameServerConnection) -> None:
        """A (re)started front's link is up: the direct data plane pushes it its table."""
        if self._plane is not None:
            self._plane.attach(connection.writer)

    def report(self, body: bytes) -> None:
        """The front's direct-path records (from the front itself, on the socket pair only it holds)."""
        if self._plane is not None:
            self._plane.report(body)

    async def answer(self, kind: int, timeout_s: float | None, credential: bytes, body: bytes) -> tuple[int, bytes]:
        handler = self._handlers.get(kind)
        if handler is None:
            return CODE_NUMBERS["UNIMPLEMENTED"], f"unknown call kind {kind}".encode()
        if self._tokens:
            principal = self._principal(credential)
            if principal is None:
                return CODE_NUMBERS["UNAUTHENTICATED"], UNAUTHENTICATED_MESSAGE.encode()
            if not principal.has(self._needed[kind]):
                return (CODE_NUMBERS["PERMISSION_DENIED"],
                        missing_role_message(METHODS[kind], self._needed[kind], principal).encode())
            if kind == _INFER and self._plane is not None:
                self._plane.allow(credential)
        if kind != _INFER or self._plane is None:
            return await as_status(handler(body, timeout_s), METHODS[kind], None, where="router")
        began = time.perf_counter()
        try:
            return await as_status(handler(body, timeout_s), METHODS[kind], None, where="router")
        finally:  # the front's demand for the model, which the direct path's lease follows
            with contextlib.suppress(wire.MalformedMessage):
                self._plane.observe(wire.read_header(body).model_name, time.perf_counter() - began)

    def _principal(self, credential: bytes) -> Principal | None:
        """Who ``credential`` names; a bounded cache, since tokens are few and callers repeat them."""
        try:
            return self._principals[credential]
        except KeyError:
            pass
        principal = bearer_principal(self._tokens, credential.decode("latin-1"))
        if len(self._principals) >= _MAX_CACHED_CREDENTIALS:  # junk credentials must not grow it without bound
            self._principals.clear()
        self._principals[credential] = principal
        return principal


def _front_environment() -> dict[str, str]:
    """gRPC's own settings (GRPC_VERBOSITY, GRPC_TRACE, ...) and nothing else: the front needs none of
    the router's secrets (tokens, S3 and broker credentials), so it never holds them."""
    return {key: value for key, value in os.environ.items() if key.startswith("GRPC_") or key in ("LANG", "TZ")}


def _decoded(message: type, body: bytes) -> object:
    """Raises: InvalidArgument (field ``request``) for bytes that are not a ``message``."""
    try:
        return message.FromString(body)  # type: ignore[attr-defined]
    except DecodeError as exc:
        raise InvalidArgument("request", f"must be an inference.{message.__name__}, but {exc}") from None


async def _model_metadata(frontend: InferenceFrontend, body: bytes, timeout_s: float | None) -> bytes:
    return await frontend.model_metadata(_decoded(pb.ModelMetadataRequest, body), timeout_s)  # type: ignore[arg-type]


def _typed(method: Callable[[object, None], Awaitable[object]], message: type) -> Callable[[bytes, float | None],
                                                                                            Awaitable[bytes]]:
    async def call(body: bytes, _timeout_s: float | None) -> bytes:
        return (await method(_decoded(message, body), None)).SerializeToString()  # type: ignore[attr-defined]
    return call


class NativeFront(Component):
    """Runs the native front on ``host:port`` (0: a free port, kept across restarts) for ``link``.

    ``start()`` raises FailedPrecondition when the binary is missing or exits before serving;
    ``port`` is the bound port afterwards. Both are idempotent. Metrics:
    ``opml_inference_router_front_restarts_total``.
    """

    def __init__(self, link: FrontLink, *, host: str, port: int, binary: Path = DEFAULT_BINARY,
                 max_receive_bytes: int, grace_s: float, tls: GrpcTlsSettings | None, control_hint: str,
                 metrics: ServiceMetrics, startup_timeout_s: float = 30.0) -> None:
        super().__init__()
        self._link = link
        self._host, self.port = host, port
        self._binary = binary
        self._max_receive_bytes = max_receive_bytes
        self._grace_s = grace_s
        self._tls = tls
        self._control_hint = control_hint
        self._startup_timeout_s = startup_timeout_s
        self._restarts = metrics.counter("front_restarts_total", "Times the native inference front exited "
                                         "while the router ran and was started again.")
        self._process: asyncio.subprocess.Process | None = None
        self._connection: FrameServerConnection | None = None
        self._supervisor: asyncio.Task | None = None

    async def on_start(self) -> None:
        if not os.access(self._binary, os.X_OK):
            raise FailedPrecondition(f"the native inference front {self._binary} is missing (run `make install`, "
                                     "which builds it), or set OPML_INFERENCE_ROUTER_NATIVE_FRONT=false")
        await self._spawn()
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise(), name="native-front")

    async def on_stop(self) -> None:
        supervisor, self._supervisor = self._supervisor, None
        await cancel_and_wait(supervisor)
        process = self._process
        if process is not None and process.returncode is None:
            _signal(process, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), timeout=self._grace_s + 5.0)
            except TimeoutError:
                _signal(process, signal.SIGKILL)
                await process.wait()
        if self._connection is not None:
            self._connection.transport.close()

    async def _spawn(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._process = await asyncio.create_subprocess_exec(
                str(self._binary), *self._arguments(theirs.fileno()), pass_fds=(theirs.fileno(),),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, env=_front_environment())
        except OSError as exc:
            ours.close()
            raise FailedPrecondition(f"the native inference front {self._binary} cannot run: {exc}") from None
        finally:
            theirs.close()
        loop = asyncio.get_running_loop()
        _transport, self._connection = await loop.connect_accepted_socket(
            lambda: FrameServerConnection(self._link), ours)
        self._link.attached(self._connection)
        try:
            line = await asyncio.wait_for(self._process.stdout.readline(), timeout=self._startup_timeout_s)  # type: ignore[union-attr]
            self.port = int(json.loads(line)["port"])
        except (TimeoutError, ValueError, KeyError) as exc:
            _signal(self._process, signal.SIGKILL)  # it may have exited by itself (a port taken)
            code = await self._process.wait()
            self._connection.transport.close()
            raise FailedPrecondition(f"the native inference front did not start on {self._host}:{self.port} "
                                     f"(exit code {code}; its error is in the router's log): "
                                     f"{type(exc).__name__}") from None
        log.info("native inference front serving", extra={"grpc": f"{self._host}:{self.port}",
                                                          "pid": self._process.pid})

    def _arguments(self, fd: int) -> list[str]:
        arguments = ["--router-fd", str(fd), "--listen", f"{self._host}:{self.port}",
                     "--max-receive-bytes", str(self._max_receive_bytes), "--grace-s", str(self._grace_s),
                     "--control-hint", self._control_hint]
        tls = self._tls
        if tls is not None and tls.grpc_tls_cert is not None and tls.grpc_tls_key is not None:
            arguments += ["--tls-cert", str(tls.grpc_tls_cert), "--tls-key", str(tls.grpc_tls_key)]
            if tls.grpc_tls_client_ca is not None:
                arguments += ["--tls-client-ca", str(tls.grpc_tls_client_ca)]
        return arguments

    async def _supervise(self) -> None:
        """Starts the front again (same port) whenever it exits while the router runs, waiting longer
        after each start that failed (a port still held, a broken binary)."""
        failed = 0
        while True:
            assert self._process is not None
            code = await self._process.wait()
            if self._connection is not None:
                self._connection.transport.close()
            log.warning("the native inference front exited; starting it again",
                        extra={"code": code, "port": self.port})
            self._restarts.inc()
            await asyncio.sleep(_RESTARTS.delay(failed))
            try:
                await self._spawn()
                failed = 0
            except OpmlError as exc:
                failed += 1
                log.error("the native inference front did not start again: %s", exc.message)


def _signal(process: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    """Sends ``sig`` with os.kill, never ``Process.kill``/``send_signal``: those poll first (waitpid
    WNOHANG), which reaps a front that has just exited before asyncio's child watcher can, and the
    watcher then reports exit code 255 instead of the front's own."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, sig)
