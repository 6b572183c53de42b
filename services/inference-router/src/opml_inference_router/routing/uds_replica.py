"""A replica on this machine reached over the worker's Unix socket (:mod:`..worker.uds`), not gRPC.

The router's cheaper hop (:mod:`..frames`) to the workers its pool manager runs: one connection per worker, many calls
in flight on it, each a request frame out and a response frame back, inside the event loop (~0.1 ms
per round trip against ~0.5 ms for grpc.aio). Same contract as :mod:`.grpc_replica`: bytes in and
out, status codes become :class:`ReplicaFailed` with the same retry decisions, a cancelled call is
cancelled on the worker, a lost connection fails its calls as UNAVAILABLE (retried elsewhere) and
the next call reconnects.
"""

from __future__ import annotations

import asyncio
import itertools

from opml_inference_router.frames import CANCEL, CODE_NAMES, KINDS, OK, RESPONSE, FrameWriter, frame_body, request_frame
from opml_inference_router.routing.errors import ReplicaFailed
from opml_inference_router.routing.grpc_replica import GrpcReplica
from opml_inference_router.routing.replicas import Replica
from opml_inference_router.worker.uds import SCHEME


class UdsReplica(Replica):
    """The worker serving ``address`` = ``uds:/path/to/worker.sock``. Connects on the first call."""

    def __init__(self, address: str) -> None:
        if not address.startswith(SCHEME):
            raise ValueError(f"address must be {SCHEME}<socket path>, but got {address!r}")
        self.name = address
        self._path = address[len(SCHEME):]
        self._connection: _Connection | None = None
        self._connecting = asyncio.Lock()
        self._ids = itertools.count(1)
        self._closed = False

    async def call(self, method: str, request: bytes, *, timeout_s: float) -> bytes:
        connection = self._connection
        if connection is None or connection.lost:
            connection = await self._connect()
        call_id = next(self._ids) & 0xFFFFFFFF
        future = connection.send(call_id, KINDS[method], timeout_s, request)
        timer = future.get_loop().call_later(timeout_s, _expire, future, timeout_s)
        try:
            status, body = await future
        except asyncio.CancelledError:
            connection.cancel(call_id)  # a backup won, or the caller left: the worker drops the call
            raise
        except ReplicaFailed as exc:
            exc.replica = self.name
            if exc.code == "DEADLINE_EXCEEDED":
                connection.cancel(call_id)
            raise
        finally:
            timer.cancel()
            connection.pending.pop(call_id, None)
        if status == OK:
            return body
        raise ReplicaFailed.of_status(CODE_NAMES.get(status, "UNKNOWN"), body.decode("utf-8", "replace"),
                                      replica=self.name)

    async def _connect(self) -> _Connection:
        async with self._connecting:
            if self._closed:
                raise ReplicaFailed("UNAVAILABLE", "the replica was closed", retriable=True, eject=True,
                                    replica=self.name)
            if self._connection is None or self._connection.lost:
                try:
                    _, self._connection = await asyncio.get_running_loop().create_unix_connection(
                        _Connection, self._path)
                except OSError as exc:
                    raise ReplicaFailed("UNAVAILABLE", f"cannot reach the worker: {exc.strerror or exc}",
                                        retriable=True, eject=True, replica=self.name) from None
            return self._connection

    async def close(self) -> None:
        self._closed = True
        if self._connection is not None:
            self._connection.transport.close()
            self._connection = None


class _Connection(asyncio.Protocol):
    """Frames out, response frames matched to their waiting call by id."""

    def __init__(self) -> None:
        self.pending: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self.lost = False
        self._buffer = bytearray()
        self.transport: asyncio.Transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()
        self.writer = FrameWriter(self.transport, self.loop)

    def send(self, call_id: int, kind: int, timeout_s: float, body: bytes) -> asyncio.Future[tuple[int, bytes]]:
        future: asyncio.Future[tuple[int, bytes]] = self.loop.create_future()
        self.pending[call_id] = future
        self.writer.write(request_frame(call_id, kind, timeout_s, body), body)
        return future

    def cancel(self, call_id: int) -> None:
        if not self.lost:
            self.writer.write(request_frame(call_id, CANCEL, 0.0))

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start, end = 0, len(buffer)
        while end - start >= RESPONSE.size:
            length, call_id, status = RESPONSE.unpack_from(buffer, start)
            body_start = start + RESPONSE.size
            if end - body_start < length:
                break
            start = body_start + length
            future = self.pending.pop(call_id, None)
            if future is not None and not future.done():
                future.set_result((status, frame_body(buffer, body_start, start)))
        del buffer[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        for future in list(self.pending.values()):
            if not future.done():
                future.set_exception(ReplicaFailed(
                    "UNAVAILABLE", "the worker closed the connection (stopped or killed)", retriable=True,
                    eject=True))


def _expire(future: asyncio.Future, timeout_s: float) -> None:
    if not future.done():
        future.set_exception(ReplicaFailed("DEADLINE_EXCEEDED", f"no answer within {timeout_s * 1000:.1f} ms",
                                           retriable=False, eject=False))


def connect(address: str, *, token: str | None = None) -> Replica:
    """The replica at ``address``: a worker's Unix socket (``uds:/path``) or gRPC (``host:port``).

    Use as the router's ``connect`` (``functools.partial(connect, token=...)``); ``token`` is the
    bearer token for gRPC workers (the socket's file permissions guard the Unix socket).
    """
    if address.startswith(SCHEME):
        return UdsReplica(address)
    return GrpcReplica(address, token=token)
