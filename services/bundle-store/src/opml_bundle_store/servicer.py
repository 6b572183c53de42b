"""The BundleStore gRPC servicer: parses requests, runs the core off the event loop, converts replies.

It holds no bundle logic and publishes no events: both are in :mod:`opml_bundle_store.core`, which
imports no grpc and announces each commit, push and delete where it happens. Domain errors raised
by the core become status codes in the shared ObservabilityInterceptor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import AsyncIterator, Callable

from google.protobuf.timestamp_pb2 import Timestamp
from opml.bundles.v1 import bundles_pb2 as pb
from opml.bundles.v1 import bundles_pb2_grpc

from opml_bundle_store.core import grants
from opml_bundle_store.core.convert import bundle_to_proto, context_to_proto, lineage_from_proto
from opml_bundle_store.core.grants import GrantKeys, UploadGrant
from opml_bundle_store.core.manifest import Bundle, TransferProgress
from opml_bundle_store.core.rules import validate_bundle_name, validate_idempotency_key
from opml_bundle_store.core.store import BundleStore
from opml_bundle_store_contract.paths import validate_bundle_paths
from opml_bundle_store_contract.values import value_from_proto
from opml_common.errors import InvalidArgument, NotFound, PermissionDenied, Unauthenticated
from opml_common.grpc.interceptors import Principal, Scope, current_principal
from opml_common.metrics import ServiceMetrics
from opml_common.pagination import paginate

_CONTEXT_NAME = re.compile(r"^contexts/([^/]+)$")
_BUNDLE_NAME = re.compile(r"^contexts/([^/]+)/bundles/([^/]+)$")
_PROGRESS_INTERVAL_S = 0.2
log = logging.getLogger(__name__)

# The role each RPC needs (checked against the service descriptor at start-up).
METHOD_ROLES = {
    "ListContexts": "reader", "GetContext": "reader", "ListBundles": "reader", "GetBundle": "reader",
    "ReadBundleFile": "reader", "GetLineage": "reader",
    "CreateContext": "writer", "UpdateContextRemote": "writer", "AddBundle": "writer", "CommitBundle": "writer",
    "PushBundles": "writer", "PullBundles": "writer",
    "CreateUploadGrant": "writer", "RevokeUploadGrant": "writer",
    "DeleteBundle": "admin", "GarbageCollect": "admin",
}

GRANT_METHODS = frozenset({"AddBundle", "GetBundle", "ListBundles"})
"""What an upload grant's holder may call (each call then checked against the grant's context and name)."""


def parse_context_name(field: str, name: str) -> str:
    match = _CONTEXT_NAME.match(name)
    if not match:
        raise InvalidArgument(field, f"must look like contexts/{{context}}, but got {name!r}")
    return match.group(1)


def parse_bundle_name(field: str, name: str) -> tuple[str, str]:
    match = _BUNDLE_NAME.match(name)
    if not match:
        raise InvalidArgument(field, f"must look like contexts/{{context}}/bundles/{{uuid or name}}, but got {name!r}")
    return match.group(1), match.group(2)


TRANSFER_DIRECTIONS = ("upload", "read", "push", "pull")
"""Where bytes move: clients adding files, clients reading files, the store pushing to and pulling from S3."""


class BundleStoreServicer(bundles_pb2_grpc.BundleStoreServicer):
    """``grant_keys`` sign the upload grants it issues and verify those presented (:meth:`verify_token`,
    the server's token verifier); ``max_grant_bytes`` bounds what one grant may allow."""

    def __init__(self, store: BundleStore, metrics: ServiceMetrics, *, grant_keys: GrantKeys,
                 max_grant_bytes: int = 4 * 1024**3, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._grant_keys = grant_keys
        self._max_grant_bytes = max_grant_bytes
        self._clock = clock
        moved = metrics.counter("transfer_bytes_total", "Bytes moved, by direction.", ("direction",))
        self._bytes = {direction: moved.labels(direction) for direction in TRANSFER_DIRECTIONS}
        self._grants = metrics.counter("upload_grants_total", "Upload grants issued.")
        self._revocations = metrics.counter("upload_grants_revoked_total", "Upload grants revoked (RevokeUploadGrant).")

    # -- upload grants ----------------------------------------------------------------------

    def verify_token(self, token: str) -> Principal | None:
        """The scoped principal of an upload grant (None: ``token`` is no grant). Raises Unauthenticated
        for a grant that does not verify or expired."""
        grant = grants.verify(self._grant_keys, token, now=self._clock())
        if grant is None:
            return None
        return Principal(grant.principal_name, frozenset({"writer"}),
                         Scope(grant.describe(), GRANT_METHODS, grant))

    async def CreateUploadGrant(self, request: pb.CreateUploadGrantRequest, context) -> pb.UploadGrant:
        violations: list[tuple[str, str]] = []
        context_id = ""
        try:
            context_id = parse_context_name("parent", request.parent)
        except InvalidArgument as error:
            violations.extend(error.violations)
        try:
            validate_bundle_name(request.bundle_name, "bundle_name")
        except InvalidArgument as error:
            violations.extend(error.violations)
        if not 1 <= request.ttl_seconds <= grants.MAX_TTL_S:
            violations.append(("ttl_seconds", f"must be in [1, {grants.MAX_TTL_S}] seconds, but got "
                                              f"{request.ttl_seconds}"))
        if not 1 <= request.max_bytes <= self._max_grant_bytes:
            violations.append(("max_bytes", f"must be in [1, {self._max_grant_bytes}] (this store's "
                                            f"OPML_BUNDLE_STORE_MAX_GRANT_BYTES), but got {request.max_bytes}"))
        if violations:
            raise InvalidArgument.of(violations)
        await asyncio.to_thread(self._store.get_context, context_id)  # NotFound: grant nothing into nowhere
        token, grant = grants.issue(self._grant_keys, context_id=context_id, bundle_name=request.bundle_name,
                                    max_bytes=request.max_bytes, ttl_s=request.ttl_seconds, now=self._clock())
        self._grants.inc()
        log.info("upload grant issued", extra={"grant": grant.grant_id, "context": context_id,
                                               "bundle_name": grant.bundle_name, "max_bytes": grant.max_bytes,
                                               "principal": current_principal().name})
        return pb.UploadGrant(token=token, grant_id=grant.grant_id,
                              expire_time=Timestamp(seconds=int(grant.expires_at)))

    async def RevokeUploadGrant(self, request: pb.RevokeUploadGrantRequest, context) -> pb.RevokedUploadGrant:
        violations: list[tuple[str, str]] = []
        context_id = ""
        try:
            context_id = parse_context_name("parent", request.parent)
        except InvalidArgument as error:
            violations.extend(error.violations)
        try:
            grants.validate_grant_id(request.grant_id)
        except InvalidArgument as error:
            violations.extend(error.violations)
        if violations:
            raise InvalidArgument.of(violations)
        revoked_at = await asyncio.to_thread(self._store.revoke_upload_grant, context_id, request.grant_id)
        self._revocations.inc()
        log.info("upload grant revoked", extra={"grant": request.grant_id, "context": context_id,
                                                "principal": current_principal().name})
        stamp = Timestamp()
        stamp.FromDatetime(revoked_at)
        return pb.RevokedUploadGrant(grant_id=request.grant_id, revoke_time=stamp)

    def _refuse_revoked(self, grant: UploadGrant) -> None:
        """Raises Unauthenticated when ``grant`` was revoked (through any replica: the revocation is kept
        with its context, on the remote of a shared one). Blocking: call it off the event loop."""
        if self._store.upload_grant_revoked(grant.context_id, grant.grant_id):
            raise Unauthenticated(f"upload grant {grant.grant_id} was revoked; ask its issuer for a new one")

    # -- contexts ---------------------------------------------------------------------------

    async def CreateContext(self, request: pb.CreateContextRequest, context) -> pb.Context:
        info = await asyncio.to_thread(self._store.create_context, request.context_id, request.remote_url or None)
        return context_to_proto(info)

    async def ListContexts(self, request: pb.ListContextsRequest, context) -> pb.ListContextsResponse:
        infos = await asyncio.to_thread(self._store.list_contexts)
        page, token = paginate(infos, request.page_size, request.page_token)
        return pb.ListContextsResponse(contexts=[context_to_proto(i) for i in page], next_page_token=token)

    async def GetContext(self, request: pb.GetContextRequest, context) -> pb.Context:
        context_id = parse_context_name("name", request.name)
        return context_to_proto(await asyncio.to_thread(self._store.get_context, context_id))

    async def UpdateContextRemote(self, request: pb.UpdateContextRemoteRequest, context) -> pb.Context:
        context_id = parse_context_name("name", request.name)
        info = await asyncio.to_thread(self._store.set_remote, context_id, request.remote_url or None)
        return context_to_proto(info)

    # -- bundles ----------------------------------------------------------------------------

    async def AddBundle(self, request_iterator: AsyncIterator[pb.AddBundleRequest], context) -> pb.Bundle:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("part") != "header":
            raise InvalidArgument("header", "the first AddBundleRequest must carry the header")
        header = first.header
        context_id = parse_context_name("header.parent", header.parent)
        if (grant := _grant()) is not None:
            _check_grant(grant, context_id, header.bundle_name)
            if header.commit:  # a commit is what the platform acts on (autodeploy, monitoring): not the holder's
                raise PermissionDenied(f"{grant.describe()} adds uncommitted versions only; whoever issued it "
                                       f"commits what it accepts")
            declared = sum(max(spec.size_bytes, 0) for spec in header.files)
            if declared > grant.max_bytes:
                raise PermissionDenied(f"the bundle declares {declared} bytes, more than the {grant.max_bytes} "
                                       f"{grant.describe()} allows")
            await asyncio.to_thread(self._refuse_revoked, grant)
        # The creator is who called, whatever the client wrote there.
        lineage = dataclasses.replace(lineage_from_proto(header.lineage, "header.lineage"),
                                      creator=current_principal().name)
        validate_bundle_paths([spec.path for spec in header.files], "files")  # before any byte is staged
        validate_idempotency_key(header.idempotency_key, "header.idempotency_key")
        values = {key: value_from_proto(value) for key, value in header.values.items()}
        for key, value in values.items():
            if value is None:
                raise InvalidArgument(f"header.values[{key!r}]", "has no value set")
        upload = _ChunkBridge(asyncio.get_running_loop(), len(header.files))

        def write() -> Bundle:
            with self._store.new_bundle(context_id, header.bundle_name, tags=dict(header.tags), values=values,
                                        lineage=lineage, idempotency_key=header.idempotency_key) as writer:
                for index, spec in enumerate(header.files):
                    writer.add_file(spec.path, upload.chunks_of(index), media_type=spec.media_type or None,
                                    expected_sha256=spec.sha256 or None, expected_size=spec.size_bytes)
                upload.expect_end()
                if grant is not None:  # revoked while it uploaded: nothing of it becomes visible
                    self._refuse_revoked(grant)
                return writer.finish(commit=header.commit)

        writer_task = asyncio.ensure_future(asyncio.to_thread(write))
        try:
            async for message in request_iterator:
                if message.WhichOneof("part") != "chunk":
                    raise InvalidArgument("chunk", "only the first AddBundleRequest may carry a header")
                if not await upload.feed(message.chunk, writer_task):
                    break
                self._bytes["upload"].inc(len(message.chunk.data))
            await upload.feed(None, writer_task)
            bundle = await writer_task
        except BaseException:
            upload.abort()
            await asyncio.gather(writer_task, return_exceptions=True)
            raise
        return bundle_to_proto(bundle)

    async def ListBundles(self, request: pb.ListBundlesRequest, context) -> pb.ListBundlesResponse:
        context_id = parse_context_name("parent", request.parent)
        if (grant := _grant()) is not None:
            if not request.bundle_name:
                raise PermissionDenied(f"{grant.describe()} lists only its own bundle name: set bundle_name")
            _check_grant(grant, context_id, request.bundle_name)
            await asyncio.to_thread(self._refuse_revoked, grant)
        bundles = await asyncio.to_thread(
            self._store.list_bundles, context_id, bundle_name=request.bundle_name or None,
            tags=dict(request.tags) or None, committed_only=request.committed_only, latest_only=request.latest_only)
        query = repr((request.parent, request.bundle_name, sorted(request.tags.items()),
                      request.committed_only, request.latest_only))
        page, token = paginate(bundles, request.page_size, request.page_token, query=query)
        return pb.ListBundlesResponse(bundles=[bundle_to_proto(b) for b in page], next_page_token=token)

    async def GetBundle(self, request: pb.GetBundleRequest, context) -> pb.Bundle:
        context_id, ref = parse_bundle_name("name", request.name)
        grant = _grant()
        if grant is not None:
            _check_grant(grant, context_id, grant.bundle_name)
            await asyncio.to_thread(self._refuse_revoked, grant)
        try:
            bundle = await asyncio.to_thread(self._store.get_bundle, context_id, ref)
        except NotFound:
            if grant is not None and ref != grant.bundle_name:
                _check_grant(grant, context_id, ref)  # a uuid it cannot see: not even whether it exists
            raise
        if grant is not None:
            _check_grant(grant, context_id, bundle.name)
        return bundle_to_proto(bundle)

    async def ReadBundleFile(self, request: pb.ReadBundleFileRequest, context) -> AsyncIterator[pb.FileChunk]:
        context_id, ref = parse_bundle_name("name", request.name)
        if not request.path:
            raise InvalidArgument("path", "must name a file of the bundle, but is empty")
        chunks = await asyncio.to_thread(self._store.open_file, context_id, ref, request.path)
        done = object()
        while (chunk := await asyncio.to_thread(next, chunks, done)) is not done:
            self._bytes["read"].inc(len(chunk))
            yield pb.FileChunk(data=chunk)

    async def CommitBundle(self, request: pb.CommitBundleRequest, context) -> pb.Bundle:
        context_id, ref = parse_bundle_name("name", request.name)
        return bundle_to_proto(await asyncio.to_thread(self._store.commit, context_id, ref))

    async def PushBundles(self, request: pb.PushBundlesRequest, context) -> AsyncIterator[pb.TransferProgress]:
        context_id = parse_context_name("parent", request.parent)
        async for message in _with_progress(
                lambda progress: self._store.push(context_id, request.bundle or None, progress=progress)):
            if message.done:
                self._bytes["push"].inc(message.bytes_done)
            yield message

    async def PullBundles(self, request: pb.PullBundlesRequest, context) -> AsyncIterator[pb.TransferProgress]:
        context_id = parse_context_name("parent", request.parent)
        async for message in _with_progress(lambda progress: self._store.pull(
                context_id, request.bundle_name or None, localize=request.localize, progress=progress)):
            if message.done:
                self._bytes["pull"].inc(message.bytes_done)
            yield message

    async def DeleteBundle(self, request: pb.DeleteBundleRequest, context) -> pb.DeleteBundleResponse:
        context_id, ref = parse_bundle_name("name", request.name)
        deleted = await asyncio.to_thread(self._store.delete_bundle, context_id, ref, remote=request.remote)
        return pb.DeleteBundleResponse(deleted_uuids=deleted)

    async def GarbageCollect(self, request: pb.GarbageCollectRequest, context) -> pb.GarbageCollectResponse:
        context_id = parse_context_name("parent", request.parent)
        if request.grace_seconds < 0:
            raise InvalidArgument("grace_seconds", f"must be >= 0, but got {request.grace_seconds}")
        report = await asyncio.to_thread(self._store.gc, context_id, remote=request.remote,
                                         grace_s=request.grace_seconds if request.HasField("grace_seconds")
                                         else 3600, dry_run=request.dry_run)
        return pb.GarbageCollectResponse(blobs_removed=report.blobs_removed, bytes_freed=report.bytes_freed,
                                         blobs_kept=report.blobs_kept)

    async def GetLineage(self, request: pb.GetLineageRequest, context) -> pb.LineageGraph:
        context_id, ref = parse_bundle_name("name", request.name)
        if request.max_depth < 0:
            raise InvalidArgument("max_depth", f"must be >= 0, but got {request.max_depth}")
        direction = request.direction or pb.GetLineageRequest.BOTH
        graph = await asyncio.to_thread(
            self._store.lineage, context_id, ref, max_depth=request.max_depth or 10,
            upstream=direction in (pb.GetLineageRequest.UPSTREAM, pb.GetLineageRequest.BOTH),
            downstream=direction in (pb.GetLineageRequest.DOWNSTREAM, pb.GetLineageRequest.BOTH))
        return pb.LineageGraph(bundles=[bundle_to_proto(b) for b in graph.bundles],
                               edges=[pb.LineageEdge(input_uuid=i, output_uuid=o) for i, o in graph.edges])


def _grant() -> UploadGrant | None:
    """The upload grant the caller holds, if it called with one (the interceptor checked its method)."""
    scope = current_principal().scope
    return scope.grant if scope is not None and isinstance(scope.grant, UploadGrant) else None


def _check_grant(grant: UploadGrant, context_id: str, bundle_name: str) -> None:
    if context_id != grant.context_id or bundle_name != grant.bundle_name:
        raise PermissionDenied(f"{grant.describe()} allows bundle {grant.bundle_name!r} in context "
                               f"{grant.context_id!r} only")


class _ChunkBridge:
    """Hands an AddBundle stream's chunks from the event loop to the writer thread, in order.

    The loop side ``feed``s chunks (backpressure: a bounded queue); the thread side iterates
    ``chunks_of(i)`` for file i. ``abort()`` unblocks the thread when the stream breaks, so the
    writer aborts and leaves nothing behind.
    """

    _END = object()
    _ABORT = object()

    def __init__(self, loop: asyncio.AbstractEventLoop, file_count: int) -> None:
        self._loop = loop
        self._file_count = file_count
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=16)
        self._last_index = 0
        self._current: object | None = None

    async def feed(self, chunk: pb.FileChunk | None, writer: asyncio.Future) -> bool:
        """Queue a chunk (None: the stream ended). False when the writer has already finished."""
        if chunk is not None:
            if not 0 <= chunk.file_index < self._file_count:
                raise InvalidArgument("chunk.file_index", f"must be in [0, {self._file_count}), "
                                                          f"but got {chunk.file_index}")
            if chunk.file_index < self._last_index:
                raise InvalidArgument("chunk.file_index", f"files must be sent in order, but got "
                                                          f"{chunk.file_index} after {self._last_index}")
            self._last_index = chunk.file_index
        put = asyncio.ensure_future(self._queue.put(self._END if chunk is None else chunk))
        await asyncio.wait({put, writer}, return_when=asyncio.FIRST_COMPLETED)
        if not put.done():
            put.cancel()
            return False
        return True

    def abort(self) -> None:
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(self._ABORT)

    def _next(self) -> object:
        if self._current is None:
            self._current = asyncio.run_coroutine_threadsafe(self._queue.get(), self._loop).result()
            if self._current is self._ABORT:
                raise ConnectionAbortedError("the AddBundle stream was interrupted")
        return self._current

    def chunks_of(self, index: int):
        while (item := self._next()) is not self._END and item.file_index == index:
            self._current = None
            yield item.data

    def expect_end(self) -> None:
        if self._next() is not self._END:
            raise InvalidArgument("chunk.file_index", "a chunk arrived after the last declared file")


async def _with_progress(run: Callable[[Callable[[TransferProgress], None]], list[Bundle]]
                         ) -> AsyncIterator[pb.TransferProgress]:
    """Run a transfer in a thread, yielding its progress (throttled) and then a final message."""
    latest: TransferProgress | None = None

    def report(progress: TransferProgress) -> None:  # called from the transfer's threads
        nonlocal latest
        latest = progress

    task = asyncio.ensure_future(asyncio.to_thread(run, report))
    sent: TransferProgress | None = None
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=_PROGRESS_INTERVAL_S)
            if latest is not None and latest is not sent and not task.done():
                sent = latest
                yield _progress_message(sent)
        bundles = await task
    finally:
        # A client that goes away does not stop the transfer: it finishes (each bundle atomically).
        if not task.done():
            await asyncio.gather(task, return_exceptions=True)
    final = _progress_message(latest) if latest is not None else pb.TransferProgress()
    final.bundles.extend(bundle_to_proto(b) for b in bundles)
    final.done = True
    yield final


def _progress_message(progress: TransferProgress) -> pb.TransferProgress:
    return pb.TransferProgress(files_done=progress.files_done, files_total=progress.files_total,
                               bytes_done=progress.bytes_done, bytes_total=progress.bytes_total)
