"""The worker's local data plane: KServe v2 calls over a Unix domain socket, for a router on the same machine.

Why not gRPC here: a grpc.aio call costs ~0.4 ms of CPU per side in Python (C-core threads hand each
call to the event loop), about half of what the router adds, whether over TCP or a Unix socket
(bench/inference_router_overhead.py measures both). This protocol runs inside the event loop with
one read per frame: a round trip costs ~0.1 ms. MLServer's front process talks to its workers over
local IPC for the same reason. Remote callers, health and the control plane keep using gRPC on TCP.

The frames are :mod:`opml_inference_router.frames`'; a worker ignores the credential field (the
router's front checks callers before a call reaches a worker).

Access: the socket file is the caller's right to call, as with Docker's socket: it is created owner-only
(0600) and the worker also refuses connections from another user (``SO_PEERCRED``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from opml_common.lifecycle import Component
from opml_common.metrics import ServiceMetrics
from opml_inference_router.frames import (
    CODE_NUMBERS,
    KINDS,
    METHODS,
    OK,
    CallCounter,
    FrameServerConnection,
    as_status,
    error_status,
)

log = logging.getLogger(__name__)

SCHEME = "uds:"  # a router address "uds:/abs/path.sock": this protocol, not gRPC
_REQUEST_TYPES = {KINDS["ModelInfer"]: pb.ModelInferRequest, KINDS["ModelMetadata"]: pb.ModelMetadataRequest,
                  KINDS["ModelReady"]: pb.ModelReadyRequest, KINDS["ServerLive"]: pb.ServerLiveRequest,
                  KINDS["ServerReady"]: pb.ServerReadyRequest, KINDS["ServerMetadata"]: pb.ServerMetadataRequest}

Handler = Callable[[object, None], Awaitable[object]]


class UdsServer(Component):
    """Serves a worker servicer's KServe methods (:data:`~opml_inference_router.frames.KINDS`) on ``path``.

    Side effects: ``start()`` binds the socket (replacing a stale file of a killed worker), owner-only;
    ``stop(grace_s)`` refuses new calls (UNAVAILABLE, so the router retries elsewhere), lets the
    running ones finish within ``grace_s`` (default: the constructor's), cancels the rest and removes
    the socket file. Both idempotent. Metrics ``opml_inference_router_worker_uds_requests_total{method,code}``.
    """

    def __init__(self, servicer: object, path: Path, *, metrics: ServiceMetrics, grace_s: float = 0.0) -> None:
        super().__init__()
        self.path = path
        self.grace_s = grace_s
        self._handlers: dict[int, Handler] = {kind: getattr(servicer, method) for method, kind in KINDS.items()
                                              if hasattr(servicer, method)}
        self._infer_now: Callable[[list[pb.ModelInferRequest]], list[pb.ModelInferResponse | Exception] | None] | None = (
            getattr(servicer, "infer_now", None))
        self.count = CallCounter(metrics, "uds_requests_total", "Calls served on the Unix socket (a local router), "
                                 "by method and status code.", self._handlers).count
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[FrameServerConnection] = set()
        self.stopping = False

    async def on_start(self) -> None:
        self.stopping = False
        self.path.unlink(missing_ok=True)
        loop = asyncio.get_running_loop()
        old_umask = os.umask(0o177)  # created 0600: no window where others could connect
        try:
            self._server = await loop.create_unix_server(
                lambda: _PeerCheckedConnection(self, on_close=self._connections.discard), str(self.path))
        finally:
            os.umask(old_umask)

    async def stop(self, grace_s: float | None = None) -> None:
        if grace_s is not None:
            self.grace_s = grace_s
        await super().stop()

    async def on_stop(self) -> None:
        self.stopping = True
        if self._server is not None:
            self._server.close()
        running = [task for connection in self._connections for task in connection.calls.values()]
        if running:
            _done, late = await asyncio.wait(running, timeout=self.grace_s)
            for task in late:
                task.cancel()
        for connection in list(self._connections):
            connection.transport.close()
        self.path.unlink(missing_ok=True)

    def answer_now(self, calls: list[tuple[int, bytes]]) -> list[tuple[int, bytes]] | None:
        """The ModelInfer calls of one read answered in the turn that read them, when the servicer's
        ``infer_now`` can (one replica, idle, short runs: one batch); None sends them the usual way.
        Never raises."""
        if self._infer_now is None or self.stopping or any(kind != KINDS["ModelInfer"] for kind, _ in calls):
            return None
        try:
            requests = [pb.ModelInferRequest.FromString(body) for _, body in calls]
        except DecodeError:
            return None  # answer() words the error
        try:
            answered = self._infer_now(requests)
        except Exception as exc:  # noqa: BLE001 - mapped as answer() maps it
            if len(calls) > 1:
                return None  # whose error it is: answer() tells each call its own
            return [error_status(exc, "ModelInfer", where="worker")]
        if answered is None:
            return None
        return [(OK, reply.SerializeToString()) if isinstance(reply, pb.ModelInferResponse)
                else error_status(reply, "ModelInfer", where="worker") for reply in answered]

    async def answer(self, kind: int, timeout_s: float | None, credential: bytes, body: bytes) -> tuple[int, bytes]:
        """(status, body) of one call; never raises but CancelledError. No timer of its own: the router
        expires its call at ``timeout_s`` and sends a cancel frame, which cancels it here (a lost
        connection cancels all of its calls), so a second timer per request would only cost CPU."""
        handler = self._handlers.get(kind)
        if handler is None:
            return CODE_NUMBERS["UNIMPLEMENTED"], f"unknown call kind {kind}".encode()
        if self.stopping:
            return CODE_NUMBERS["UNAVAILABLE"], b"the worker is shutting down"
        try:
            request = _REQUEST_TYPES[kind].FromString(body)
        except DecodeError as exc:
            return CODE_NUMBERS["INVALID_ARGUMENT"], f"request: not a {METHODS[kind]} request: {exc}".encode()
        return await as_status(_serialized(handler(request, None)), METHODS[kind], None, where="worker")


async def _serialized(reply: Awaitable[object]) -> bytes:
    return (await reply).SerializeToString()  # type: ignore[attr-defined]


class _PeerCheckedConnection(FrameServerConnection):
    """A router's connection, refused unless its process runs as our user (``SO_PEERCRED``)."""

    service: UdsServer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        sock: socket.socket = transport.get_extra_info("socket")
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
        if uid != os.getuid():
            log.warning("refused a Unix socket connection from uid %d", uid)
            transport.close()
            return
        self.service._connections.add(self)  # noqa: SLF001 - the server's own bookkeeping


@contextlib.asynccontextmanager
async def serving(servicer: object, path: Path, *, metrics: ServiceMetrics, grace_s: float):
    """``UdsServer`` for the body of an ``async with``; stopped (gracefully) on exit."""
    async with UdsServer(servicer, path, metrics=metrics, grace_s=grace_s) as server:
        yield server
