"""The router's frame protocol: KServe v2 calls as length-prefixed frames over a local stream socket.

Two links speak it, both inside one event loop with one read per burst of frames: the router to its
workers' Unix sockets (:mod:`.worker.uds`, :mod:`.routing.uds_replica`), and the native gRPC front
(``native/front.cc``, :mod:`.native_front`) to the router. Why not gRPC there: a grpc.aio call costs
~0.3-0.4 ms of CPU per side in Python; a frame round trip costs ~0.1 ms.

Frames (little-endian), many calls in flight per connection, answered in any order:

- request: ``u32 body length, u32 call id, u8 kind, f64 timeout s, u16 credential length`` +
  credential + body (a serialized ``ModelInferRequest``, ``ModelMetadataRequest``, ... by
  :data:`KINDS`); timeout 0: the caller set no deadline; the credential is the caller's
  ``authorization`` header on the front's link (the router checks it) and empty towards a worker (the
  socket's file mode and peer credentials guard it). Kind :data:`CANCEL` with no body cancels the call
  (a hedged request that lost, a caller that went away). On the front's link, kind :data:`REPORT`
  carries the front's direct-path records, and a response frame with call id 0 is the router's push
  (route table, auth verdicts; :mod:`.data_plane`).
- response: ``u32 body length, u32 call id, u8 status`` + body: the serialized response when the
  status is 0 (OK), else the error message; statuses are gRPC's code numbers, so the receiver decides
  retries as for gRPC.

Both sides write through a :class:`FrameWriter`: the frames of one turn of the event loop leave in
one write, so the peer wakes once for all of them instead of once per frame (a send on a loaded
2-core machine costs a wake-up and often a context switch).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

import grpc

from opml_common.errors import OpmlError
from opml_common.metrics import ServiceMetrics

log = logging.getLogger(__name__)

REQUEST = struct.Struct("<IIBdH")
RESPONSE = struct.Struct("<IIB")
CANCEL = 0
REPORT = 7
"""Front -> router on the native front's link: what its direct path did (:mod:`.data_plane`). Never
answered: an empty answer every 5 ms cost the router a send and the front's link thread a wake-up."""
MAX_FRAME = 64 * 1024 * 1024  # as gRPC's message limit on both sides
KINDS = {"ModelInfer": 1, "ModelMetadata": 2, "ModelReady": 3, "ServerLive": 4, "ServerReady": 5,
         "ServerMetadata": 6}
METHODS = {number: name for name, number in KINDS.items()}
OK = 0
CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
CODE_NUMBERS = {name: number for number, name in CODE_NAMES.items()}

COALESCE_BELOW = 64 * 1024
"""Frames shorter than this wait for the end of the loop's turn to leave with the others; a longer
one is written at once (after those before it), so a large tensor is never copied into a join."""


def request_frame(call_id: int, kind: int, timeout_s: float, body: bytes = b"") -> bytes:
    """The header of a request frame without a credential (the router's calls to its workers)."""
    return REQUEST.pack(len(body), call_id, kind, timeout_s, 0)


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


async def as_status(call: Awaitable[bytes], method: str, timeout_s: float | None, *,
                    where: str) -> tuple[int, bytes]:
    """(status, body) of one call: platform errors become their codes with their messages, a timeout
    DEADLINE_EXCEEDED, anything else INTERNAL with an incident id (the traceback is logged, never
    sent). Never raises but CancelledError."""
    try:
        if timeout_s is None:  # no timer to arm (the router's own deadline handling runs inside the call)
            return OK, await call
        async with asyncio.timeout(timeout_s):
            return OK, await call
    except TimeoutError:
        return CODE_NUMBERS["DEADLINE_EXCEEDED"], f"no answer within {timeout_s * 1000:.1f} ms".encode()
    except Exception as exc:  # noqa: BLE001 - mapped, never leaked
        return error_status(exc, method, where=where)


def error_status(exc: Exception, method: str, *, where: str) -> tuple[int, bytes]:
    """(status, body) of a call that raised ``exc``: a platform error's code and message, anything else
    INTERNAL with an incident id (the traceback is logged, never sent). Call it from the ``except``."""
    if isinstance(exc, OpmlError):
        return CODE_NUMBERS.get(exc.code, CODE_NUMBERS["UNKNOWN"]), exc.message.encode()
    incident = uuid.uuid4().hex[:12]
    log.exception("unhandled error in %s on %s (incident %s)", method, where, incident)
    return CODE_NUMBERS["INTERNAL"], f"internal error (incident {incident}); see the {where}'s logs".encode()


class CallCounter:
    """A frame server's calls by method and status code (``count`` is a FrameService's): each
    served method's OK series exists from 0, as the gRPC servers' RPC series do, so a rate panel
    reads 0 rather than no data; other series are made on first use and kept."""

    __slots__ = ("_counter", "_children")

    def __init__(self, metrics: ServiceMetrics, name: str, doc: str, kinds: Iterable[int]) -> None:
        self._counter = metrics.counter(name, doc, ("method", "code"))
        self._children = {(kind, "OK"): self._counter.labels(METHODS[kind], "OK") for kind in kinds}

    def count(self, kind: int, code: str) -> None:
        child = self._children.get((kind, code))
        if child is None:
            child = self._children[(kind, code)] = self._counter.labels(METHODS.get(kind, str(kind)), code)
        child.inc()


class FrameService(Protocol):
    """What a :class:`FrameServerConnection` serves: answers calls and counts them."""

    def answer(self, kind: int, timeout_s: float | None, credential: bytes, body: bytes) -> Awaitable[tuple[int, bytes]]:
        """(status, body) of one call; never raises but CancelledError."""

    def count(self, kind: int, code: str) -> None: ...


class TakesReports(Protocol):
    """A :class:`FrameService` that takes :data:`REPORT` frames: applied as they are read, never answered."""

    def report(self, body: bytes) -> None:
        """Applies one report. Never raises."""


class AnswersNow(Protocol):
    """A :class:`FrameService` that can also answer some calls in place, in the turn of the event loop that
    read them: no task, no future, no wake-up of another task (the calls of one read, ModelInfer on an
    idle replica, run as one batch)."""

    def answer_now(self, calls: list[tuple[int, bytes]]) -> list[tuple[int, bytes]] | None:
        """(status, body) of each call (kind, body), in order, if all could be answered at once, else None
        (they are then served by :meth:`FrameService.answer` as usual). Never raises."""


class FrameServerConnection(asyncio.Protocol):
    """The serving end of one connection: request frames in, a task per call, response frames out as
    calls finish; a cancel frame or the connection's loss cancels the calls it concerns. The calls of one
    read that a service with ``answer_now`` (:class:`AnswersNow`) can answer at once are answered in place; a report
    frame goes to the service's ``report`` (:class:`TakesReports`) unanswered.
    ``on_close`` runs when the connection is lost (the owner's bookkeeping)."""

    def __init__(self, service: FrameService, *, on_close: Callable[[FrameServerConnection], None] | None = None) -> None:
        self.service = service
        self.calls: dict[int, asyncio.Task] = {}
        self._on_close = on_close
        self._answer_now: Callable[[list[tuple[int, bytes]]], list[tuple[int, bytes]] | None] | None = getattr(
            service, "answer_now", None)
        self._report: Callable[[bytes], None] | None = getattr(service, "report", None)
        self._buffer = bytearray()
        self.transport: asyncio.Transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.writer = FrameWriter(self.transport, asyncio.get_running_loop())

    def connection_lost(self, exc: Exception | None) -> None:
        if self._on_close is not None:
            self._on_close(self)
        for task in self.calls.values():  # the caller went away: nobody waits for these
            task.cancel()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start, end = 0, len(buffer)
        loop = asyncio.get_running_loop()
        if self._answer_now is not None:
            start = self._answered_now(self._answer_now, buffer, end)
        while end - start >= REQUEST.size:
            length, call_id, kind, timeout_s, credential_length = REQUEST.unpack_from(buffer, start)
            if length > MAX_FRAME:  # not a peer speaking this protocol: drop it rather than buffer
                log.warning("closed a frame connection that sent a %d-byte frame", length)
                self.transport.close()
                return
            credential_start = start + REQUEST.size
            body_start = credential_start + credential_length
            if end - body_start < length:
                break
            start = body_start + length
            if kind == CANCEL:
                task = self.calls.pop(call_id, None)
                if task is not None:
                    task.cancel()
                continue
            if kind == REPORT and self._report is not None:
                self._report(frame_body(buffer, body_start, start))
                continue
            credential = bytes(buffer[credential_start:body_start]) if credential_length else b""
            task = loop.create_task(self._call(call_id, kind, timeout_s or None, credential,
                                               frame_body(buffer, body_start, start)))
            self.calls[call_id] = task
        del buffer[:start]

    def _answered_now(self, answer_now: Callable[[list[tuple[int, bytes]]], list[tuple[int, bytes]] | None],
                      buffer: bytearray, end: int) -> int:
        """Where the frames ``answer_now`` answered in place end in ``buffer`` (0: none). It is offered the
        complete call frames at the head of ``buffer`` when they are all calls (no cancel, no report):
        together, so a batcher runs them as one batch."""
        calls: list[tuple[int, int, bytes]] = []
        start = 0
        while end - start >= REQUEST.size:
            length, call_id, kind, _timeout_s, credential_length = REQUEST.unpack_from(buffer, start)
            body_start = start + REQUEST.size + credential_length
            if kind in (CANCEL, REPORT) or length > MAX_FRAME:
                return 0
            if end - body_start < length:
                break
            start = body_start + length
            calls.append((call_id, kind, frame_body(buffer, body_start, start)))
        if not calls:
            return 0
        began = time.perf_counter()
        answered = answer_now([(kind, body) for _, kind, body in calls])
        if answered is None:
            return 0
        for (call_id, kind, _), answer in zip(calls, answered, strict=True):
            self._finish(call_id, kind, answer, began)
        self.writer.flush()  # nothing else of this turn to wait for
        return start

    def _finish(self, call_id: int, kind: int, answered: tuple[int, bytes], began: float) -> None:
        status, reply = answered
        self.service.count(kind, CODE_NAMES.get(status, "UNKNOWN"))
        self.writer.write(RESPONSE.pack(len(reply), call_id, status), reply)
        if status != OK:
            log.info("frame call", extra={"method": METHODS.get(kind), "code": CODE_NAMES.get(status),
                                          "duration_ms": round((time.perf_counter() - began) * 1000, 3)})

    async def _call(self, call_id: int, kind: int, timeout_s: float | None, credential: bytes, body: bytes) -> None:
        began = time.perf_counter()
        try:
            status, reply = await self.service.answer(kind, timeout_s, credential, body)
        except asyncio.CancelledError:
            self.service.count(kind, "CANCELLED")
            raise
        finally:
            self.calls.pop(call_id, None)
        self._finish(call_id, kind, (status, reply), began)
