"""The worker's local data plane: KServe v2 calls over a Unix domain socket, for a router on the same machine.

Why not gRPC here: a grpc.aio call costs ~0.4 ms of CPU per side in Python (C-core threads hand each
call to the event loop), about half of what the router adds, whether over TCP or a Unix socket
(bench/inference_router_overhead.py measures both). This protocol runs inside the event loop with
one read per frame: a round trip costs ~0.1 ms. MLServer's front process talks to its workers over
local IPC for the same reason. Remote callers, health and the control plane keep using gRPC on TCP.

Frames (little-endian), many calls in flight per connection, answered in any order:

- request: ``u32 body length, u32 call id, u8 kind, f64 timeout s`` + body (a serialized
  ``ModelInferRequest``, ``ModelMetadataRequest`` or ``ModelReadyRequest``); kind ``CANCEL`` with no
  body cancels the call (a hedged request that lost: the batcher drops it from its queue);
- response: ``u32 body length, u32 call id, u8 status`` + body: the serialized response when the
  status is 0 (OK), else the error message; statuses are gRPC's code numbers, so the router decides
  retries as for gRPC.

Both sides write through a :class:`FrameWriter`: the frames of one turn of the event loop (the
requests the router's front took in one read, the answers of one batch) leave in one write, so
the peer wakes once for all of them instead of once per frame (a send on a loaded 2-core machine
costs a wake-up and often a context switch: it was most of the router's own CPU per request).

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
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from opml_common.errors import OpmlError
from opml_common.metrics import ServiceMetrics

log = logging.getLogger(__name__)

SCHEME = "uds:"  # a router address "uds:/abs/path.sock": this protocol, not gRPC
REQUEST = struct.Struct("<IIBd")
RESPONSE = struct.Struct("<IIB")
CANCEL = 0
MAX_FRAME = 64 * 1024 * 1024  # as gRPC's message limit on both sides
KINDS = {"ModelInfer": 1, "ModelMetadata": 2, "ModelReady": 3}
OK = 0
CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
_CODE_NUMBERS = {name: number for number, name in CODE_NAMES.items()}
_REQUEST_TYPES = {KINDS["ModelInfer"]: pb.ModelInferRequest, KINDS["ModelMetadata"]: pb.ModelMetadataRequest,
                  KINDS["ModelReady"]: pb.ModelReadyRequest}
_METHODS = {number: name for name, number in KINDS.items()}


COALESCE_BELOW = 64 * 1024
"""Frames shorter than this wait for the end of the loop's turn to leave with the others; a longer
one is written at once (after those before it), so a large tensor is never copied into a join."""


class FrameWriter:
    """Frames (a header and a body) to ``transport``, the frames of one event-loop turn in one write.

    Order is kept. A flush after the transport closed drops the frames: the peer is gone, and its
    callers learn that from ``connection_lost``."""

    __slots__ = ("_transport", "_loop", "_parts")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._parts: list[bytes] = []

    def write(self, header: bytes, body: bytes = b"") -> None:
        parts = self._parts
        if len(body) >= COALESCE_BELOW:
            if parts:
                self.flush()
            if not self._transport.is_closing():
                self._transport.write(header)
                self._transport.write(body)
            return
        if not parts:
            self._loop.call_soon(self.flush)
        parts.append(header)
        if body:
            parts.append(body)

    def flush(self) -> None:
        parts = self._parts
        if not parts:
            return
        self._parts = []
        if not self._transport.is_closing():
            self._transport.write(b"".join(parts))


def frame_body(buffer: bytearray, start: int, end: int) -> bytes:
    """``buffer[start:end]`` as bytes in one copy (``bytes(buffer[start:end])`` copies twice: ~14 ms
    instead of ~0.5 ms for a 10 MB tensor). The view is released before the caller trims ``buffer``."""
    with memoryview(buffer) as view:
        return view[start:end].tobytes()


Handler = Callable[[object, None], Awaitable[object]]


class UdsServer:
    """Serves a worker servicer's ``ModelInfer``, ``ModelMetadata`` and ``ModelReady`` on ``path``.

    Side effects: ``start()`` binds the socket (replacing a stale file of a killed worker), owner-only;
    ``stop(grace_s)`` refuses new calls (UNAVAILABLE, so the router retries elsewhere), lets the
    running ones finish within ``grace_s``, cancels the rest and removes the socket file. Metrics
    ``opml_inference_router_worker_uds_requests_total{method,code}``.
    """

    def __init__(self, servicer: object, path: Path, *, metrics: ServiceMetrics) -> None:
        self.path = path
        self._handlers: dict[int, Handler] = {kind: getattr(servicer, method) for method, kind in KINDS.items()}
        self._requests = metrics.counter("uds_requests_total", "Calls served on the Unix socket (a local router), "
                                         "by method and status code.", ("method", "code"))
        # every method's OK series from 0, as the gRPC servers' RPC series are: a rate panel reads 0, not no data
        self._counted: dict[tuple[int, str], object] = {
            (kind, "OK"): self._requests.labels(method, "OK") for method, kind in KINDS.items()}
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self.stopping = False

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)
        loop = asyncio.get_running_loop()
        old_umask = os.umask(0o177)  # created 0600: no window where others could connect
        try:
            self._server = await loop.create_unix_server(lambda: _Connection(self), str(self.path))
        finally:
            os.umask(old_umask)

    async def stop(self, grace_s: float) -> None:
        self.stopping = True
        if self._server is not None:
            self._server.close()
        running = [task for connection in self._connections for task in connection.calls.values()]
        if running:
            _done, late = await asyncio.wait(running, timeout=grace_s)
            for task in late:
                task.cancel()
        for connection in list(self._connections):
            connection.transport.close()
        self.path.unlink(missing_ok=True)

    def count(self, kind: int, code: str) -> None:
        child = self._counted.get((kind, code))
        if child is None:
            child = self._counted[(kind, code)] = self._requests.labels(_METHODS.get(kind, str(kind)), code)
        child.inc()  # type: ignore[attr-defined]

    async def answer(self, kind: int, timeout_s: float, body: bytes) -> tuple[int, bytes]:
        """(status, body) of one call; never raises but CancelledError."""
        handler = self._handlers.get(kind)
        if handler is None:
            return _CODE_NUMBERS["UNIMPLEMENTED"], f"unknown call kind {kind}".encode()
        if self.stopping:
            return _CODE_NUMBERS["UNAVAILABLE"], b"the worker is shutting down"
        try:
            request = _REQUEST_TYPES[kind].FromString(body)
            async with asyncio.timeout(timeout_s):
                reply = await handler(request, None)
        except OpmlError as exc:
            return _CODE_NUMBERS.get(exc.code, _CODE_NUMBERS["UNKNOWN"]), exc.message.encode()
        except TimeoutError:
            return _CODE_NUMBERS["DEADLINE_EXCEEDED"], f"no answer within {timeout_s * 1000:.1f} ms".encode()
        except DecodeError as exc:
            return _CODE_NUMBERS["INVALID_ARGUMENT"], f"request: not a {_METHODS[kind]} request: {exc}".encode()
        except Exception:  # noqa: BLE001 - mapped, never leaked
            incident = uuid.uuid4().hex[:12]
            log.exception("unhandled error in %s on the Unix socket (incident %s)", _METHODS[kind], incident)
            return _CODE_NUMBERS["INTERNAL"], f"internal error (incident {incident}); see the worker's logs".encode()
        return OK, reply.SerializeToString()  # type: ignore[attr-defined]


class _Connection(asyncio.Protocol):
    """One router connection: frames in, a task per call, frames out as calls finish."""

    def __init__(self, server: UdsServer) -> None:
        self.server = server
        self.calls: dict[int, asyncio.Task] = {}
        self._buffer = bytearray()
        self.transport: asyncio.Transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.writer = FrameWriter(self.transport, asyncio.get_running_loop())
        sock: socket.socket = transport.get_extra_info("socket")
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
        if uid != os.getuid():
            log.warning("refused a Unix socket connection from uid %d", uid)
            transport.close()
            return
        self.server._connections.add(self)  # noqa: SLF001 - the server's own bookkeeping

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._connections.discard(self)  # noqa: SLF001
        for task in self.calls.values():  # the router went away: nobody waits for these
            task.cancel()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start, end = 0, len(buffer)
        loop = asyncio.get_running_loop()
        while end - start >= REQUEST.size:
            length, call_id, kind, timeout_s = REQUEST.unpack_from(buffer, start)
            if length > MAX_FRAME:  # not a router speaking this protocol: drop it rather than buffer
                log.warning("closed a Unix socket connection that sent a %d-byte frame", length)
                self.transport.close()
                return
            body_start = start + REQUEST.size
            if end - body_start < length:
                break
            start = body_start + length
            if kind == CANCEL:
                task = self.calls.pop(call_id, None)
                if task is not None:
                    task.cancel()
                continue
            task = loop.create_task(self._call(call_id, kind, timeout_s, frame_body(buffer, body_start, start)))
            self.calls[call_id] = task
        del buffer[:start]

    async def _call(self, call_id: int, kind: int, timeout_s: float, body: bytes) -> None:
        began = time.perf_counter()
        try:
            status, reply = await self.server.answer(kind, timeout_s, body)
        except asyncio.CancelledError:
            self.server.count(kind, "CANCELLED")
            raise
        finally:
            self.calls.pop(call_id, None)
        self.server.count(kind, CODE_NAMES.get(status, "UNKNOWN"))
        self.writer.write(RESPONSE.pack(len(reply), call_id, status), reply)
        if status != OK:
            log.info("uds call", extra={"method": _METHODS.get(kind), "code": CODE_NAMES.get(status),
                                        "duration_ms": round((time.perf_counter() - began) * 1000, 3)})


@contextlib.asynccontextmanager
async def serving(servicer: object, path: Path, *, metrics: ServiceMetrics, grace_s: float):
    """``UdsServer`` for the body of an ``async with``; stopped (gracefully) on exit."""
    server = UdsServer(servicer, path, metrics=metrics)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace_s)
