"""The bundle store: contexts of bundles on local disk, pushed to and pulled from S3.

This is the transport-free core of the bundle-store service: the gRPC servicer converts messages
and calls these methods (through ``asyncio.to_thread``), and every method is safe to call from many
threads at once. Failures are platform errors (:mod:`opml_common.errors`):

* :class:`InvalidArgument` - an argument breaks a rule (the field is named, the value shown);
* :class:`NotFound` - the context, bundle or file does not exist;
* :class:`AlreadyExists` - ``create_context`` of an existing id; an add of an idempotency key taken by
  an add of other content;
* :class:`FailedPrecondition` - the state forbids the call (push without a remote, push of an
  uncommitted bundle, reading a file that was not pulled, a home used by another process);
* :class:`DataLoss` - stored bytes do not match their sha256 (locally or on the remote);
  remote manifests that fail verification (a missing or invalid signature among them) are skipped
  and reported, not raised;
* :class:`Unavailable` - S3 cannot be reached right now (retriable).

Durability: a bundle becomes visible only when its manifest is renamed into place, after its
blobs are durable; a crash mid-add leaves staging files that the next open removes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import threading
import uuid as uuid_mod
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

from minio import Minio

from opml_bundle_store.core import gc
from opml_bundle_store.core.context import ContextState, load_context, now
from opml_bundle_store.core.events import COMMITTED, DELETED, PUSHED, BundleEvents, Intent
from opml_bundle_store.core.grants import MAX_TTL_S, validate_grant_id
from opml_bundle_store.core.layout import ContextDir, atomic_write, fsync_dir
from opml_bundle_store.core.lineage import lineage_graph
from opml_bundle_store.core.manifest import (
    Bundle,
    ContextInfo,
    FileEntry,
    GcReport,
    Lineage,
    LineageGraph,
    age,
    label,
    latest_version,
)
from opml_bundle_store.core.remote import S3Remote
from opml_bundle_store.core.remote_url import normalize_remote_url
from opml_bundle_store.core.rules import (
    check_int,
    is_uuid,
    validate_bundle_name,
    validate_context_id,
    validate_idempotency_key,
    validate_lineage,
    validate_string_map,
    validate_values,
)
from opml_bundle_store.core.signing import ManifestKeys
from opml_bundle_store.core.sync import ProgressCallback, RejectedCallback, RemoteSync
from opml_bundle_store.core.transfer import TransferSettings
from opml_bundle_store.core.writer import READ_CHUNK, BundleWriter, check_same_request
from opml_bundle_store_contract.paths import validate_bundle_path
from opml_bundle_store_contract.values import Value
from opml_common.errors import AlreadyExists, DataLoss, FailedPrecondition, InvalidArgument, NotFound, OpmlError
from opml_common.events import EventEmitter

log = logging.getLogger(__name__)

MIB = 1024 * 1024
_KEYED_UUIDS = uuid_mod.UUID("8b0f6c1e-4d0a-5b7e-9a53-0c6f4e2d7a19")
"""The namespace of the uuids a shared context derives from an add's name and idempotency key."""
S3_MIN_PART_SIZE = 5 * MIB
S3_MAX_PART_SIZE = 5 * 1024 * MIB


def lock_home(home: Path) -> BinaryIO:
    """Take the exclusive lock on ``home``, held while the file returned is open: one process owns a home.

    Raises:
        FailedPrecondition: another process, or another open store, holds it.
    """
    home.mkdir(parents=True, exist_ok=True)
    handle = open(home / ".lock", "a+b")  # noqa: SIM115 - held for the owner's lifetime
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise FailedPrecondition(
            f"the bundle store home {str(home)!r} is in use by another BundleStore "
            "(one process, one open store per home): close it first"
        ) from None
    return handle


class BundleStore:
    """All contexts under one home directory (the service's data dir); remotes through minio.

    Opening the store takes an exclusive lock on ``home`` (one process owns a home), then
    recovers from crashes: staging and download leftovers of adds and pulls that never finished
    are removed. Multipart upload states are kept so the next push resumes them.

    Args:
        home: the data directory; ``home/contexts/<id>/`` holds each context.
        s3: the client for remotes, or None for a local-only store (remote calls then fail
            with FailedPrecondition).
        transfer_workers: threads moving blobs; shared by all concurrent pushes and pulls.
        multipart_threshold: blobs of at least this many bytes are pushed as multipart uploads.
        part_size: multipart part size (S3: >= 5 MiB).
        upload_streams: big parts of one push in flight at once (at most ``transfer_workers``).
        download_streams: range GETs of one pull in flight at once (at most ``transfer_workers``).
        range_size: pulls fetch blobs larger than this as parallel range GETs of this size.
        events: where the store announces commits, pushes and deletes (the service's outbox
            emitter); None announces nothing (a tool or benchmark using the store directly).
        manifest_keys: the keys that sign the manifests a push writes (the first) and verify those a
            pull reads (any); every store sharing a remote holds the same. None: the key the store
            keeps in ``home/manifest.key``, made at the first open (:meth:`ManifestKeys.kept_in`).
        on_rejected_manifest: called (on the pulling thread) with each remote manifest a pull
            refused and skipped, after it is logged; the service counts them in a metric.
        home_lock: the lock on ``home`` (:func:`lock_home`) when the caller took it first (the service,
            before it opens its outbox under ``home``); the caller releases it. None: the store takes
            it, and ``close()`` releases it.
        staging_ttl_s: a shared context's uncommitted bundle staged on its remote longer than this is
            abandoned: a remote gc removes it (then its blobs, after their grace).

    Raises:
        InvalidArgument: a setting is out of range.
        FailedPrecondition: another process holds ``home``, or its ``manifest.key`` is not a key.
    """

    def __init__(
        self,
        home: Path,
        s3: Minio | None,
        *,
        transfer_workers: int = 32,
        multipart_threshold: int = 64 * MIB,
        part_size: int = 16 * MIB,
        upload_streams: int = 4,
        download_streams: int = 4,
        range_size: int = 32 * MIB,
        events: EventEmitter | None = None,
        manifest_keys: ManifestKeys | None = None,
        on_rejected_manifest: RejectedCallback | None = None,
        home_lock: BinaryIO | None = None,
        staging_ttl_s: float = 7 * 86400,
    ) -> None:
        check_int("transfer_workers", transfer_workers, 1, 256)
        check_int("part_size", part_size, S3_MIN_PART_SIZE, S3_MAX_PART_SIZE,
                   "(S3 refuses parts under 5 MiB)")
        check_int("multipart_threshold", multipart_threshold, S3_MIN_PART_SIZE, 5 * 1024 * 1024 * MIB)
        check_int("upload_streams", upload_streams, 1, 256)
        check_int("download_streams", download_streams, 1, 256)
        check_int("range_size", range_size, MIB, S3_MAX_PART_SIZE)
        check_int("staging_ttl_s", int(staging_ttl_s), 1, 10 * 365 * 86400)
        self.home = Path(home)
        self._s3 = s3
        self._staging_ttl_s = staging_ttl_s
        self._settings = TransferSettings(
            part_size=part_size, multipart_threshold=multipart_threshold, max_in_flight=transfer_workers,
            upload_streams=min(upload_streams, transfer_workers),
            download_streams=min(download_streams, transfer_workers), range_size=range_size,
        )
        self._contexts_dir = self.home / "contexts"
        self._contexts_dir.mkdir(parents=True, exist_ok=True)
        self._home_lock = home_lock or lock_home(self.home)
        self._owns_home_lock = home_lock is None
        self._lock = threading.RLock()
        self._contexts: dict[str, ContextState] = {}
        self._events = BundleEvents(events, self.home / "announcing")
        self._closed = False
        try:
            keys = manifest_keys or ManifestKeys.kept_in(self.home)
            self._open_contexts()
        except BaseException:
            self._release_home()
            raise
        self._pool = ThreadPoolExecutor(transfer_workers, thread_name_prefix="bundle-store-xfer")
        self._sync = RemoteSync(self._pool, self._settings, self._events, keys, on_rejected_manifest)
        try:
            self._events.recover(self._shows_change)
        except BaseException:
            self.close()
            raise

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the transfer threads and release ``home``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._release_home()

    def __enter__(self) -> BundleStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _release_home(self) -> None:
        if self._owns_home_lock:
            self._home_lock.close()

    def _open_contexts(self) -> None:
        for leftover in self._contexts_dir.glob(".tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        for root in sorted(self._contexts_dir.iterdir()):
            if not root.is_dir() or root.name.startswith("."):
                continue
            ctx = load_context(root)
            if ctx is not None:
                self._contexts[ctx.id] = ctx

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPrecondition("the bundle store is closed")

    # -- contexts ------------------------------------------------------------------------------

    def create_context(self, context_id: str, remote_url: str | None = None) -> ContextInfo:
        """Create a local context, optionally bound to ``s3://bucket/prefix`` (the bucket is
        created if missing).

        Raises:
            InvalidArgument: bad ``context_id`` or ``remote_url``.
            AlreadyExists: the context exists.
            FailedPrecondition: a remote was given but the store has no S3 client.
            Unavailable: S3 cannot be reached.
        """
        self._check_open()
        validate_context_id(context_id)
        url = normalize_remote_url(remote_url)
        with self._lock:
            if context_id in self._contexts:
                raise AlreadyExists(f"context {context_id!r} already exists (contexts/{context_id})")
        if url is not None:
            self._remote(url).ensure_bucket()
        with self._lock:
            if context_id in self._contexts:
                raise AlreadyExists(f"context {context_id!r} already exists (contexts/{context_id})")
            tmp_root = self._contexts_dir / f".tmp-{uuid_mod.uuid4().hex}"
            directory = ContextDir(tmp_root)
            directory.create_dirs()
            atomic_write(directory.context_file, json.dumps({"id": context_id, "remote_url": url}).encode())
            os.rename(tmp_root, self._contexts_dir / context_id)
            fsync_dir(self._contexts_dir)
            ctx = ContextState(context_id, ContextDir(self._contexts_dir / context_id), url)
            self._contexts[context_id] = ctx
        log.info("created context %s (remote %s)", context_id, url or "none")
        return ctx.info()

    def list_contexts(self) -> list[ContextInfo]:
        """Every context, by id."""
        with self._lock:
            contexts = sorted(self._contexts.values(), key=lambda ctx: ctx.id)
        return [ctx.info() for ctx in contexts]

    def get_context(self, context_id: str) -> ContextInfo:
        """Raises: InvalidArgument, NotFound."""
        return self._context(context_id).info()

    def set_remote(self, context_id: str, remote_url: str | None) -> ContextInfo:
        """Bind the context to ``s3://bucket/prefix`` (bucket created if missing), or unbind it
        with None or ''. Bundles keep the remote they were pushed to in ``remote_url``; those not
        yet on the new remote are pushed by the next ``push()``.

        Raises: InvalidArgument, NotFound, FailedPrecondition (no S3 client), Unavailable.
        """
        ctx = self._context(context_id)
        url = normalize_remote_url(remote_url)
        if url is not None:
            self._remote(url).ensure_bucket()
        with ctx.lock:
            atomic_write(ctx.dir.context_file, json.dumps({"id": ctx.id, "remote_url": url}).encode())
            ctx.remote_url = url
        return ctx.info()

    def share_context(self, context_id: str, remote_url: str) -> ContextInfo:
        """Serve ``context_id`` as one of several stores sharing ``remote_url`` (created here if
        missing, bound to it if not), with the remote as the truth for its committed bundles: a
        commit is pushed before it returns (blobs first, the manifest last, one manifest key per
        uuid, so no two stores' commits overwrite each other), and reads merge the remote's
        manifests (a list, a name's latest, a uuid not held here; files are fetched when read).
        Uncommitted bundles are staged there too (blobs, then a signed manifest under ``staging/``), so
        any store can read or commit one another store received. Committed bundles not yet on the
        remote (a store stopped between a commit and its push) are pushed now, uncommitted ones not yet
        staged are staged.

        Raises: InvalidArgument, FailedPrecondition (no S3 client), Unavailable.
        """
        url = normalize_remote_url(remote_url)
        if url is None:
            raise InvalidArgument("remote_url", f"a shared context needs a remote, but got {remote_url!r}")
        try:
            self.create_context(context_id, url)
        except AlreadyExists:
            if self.get_context(context_id).remote_url != url:
                self.set_remote(context_id, url)
        ctx = self._context(context_id)
        ctx.shared = True
        pushed = self._sync.push(ctx, self._context_remote(ctx), unstage=True)
        with ctx.lock:
            unstaged = sorted((b for b in ctx.bundles.values() if not b.committed and b.remote_url != url), key=age)
        for bundle in unstaged:
            self._stage(ctx, bundle)
        log.info("context %s is shared through %s (%d commits pushed and %d uncommitted bundles staged that had "
                 "not been)", context_id, url, len(pushed), len(unstaged))
        return ctx.info()

    def _merge_remote(self, ctx: ContextState, bundle_name: str | None = None) -> None:
        """A shared context: the remote's manifests (of ``bundle_name``, or all) it does not hold yet,
        metadata only. Raises: Unavailable."""
        if ctx.shared:
            self._sync.pull(ctx, self._context_remote(ctx), bundle_name)

    def _write_through(self, ctx: ContextState) -> Any:
        """What a shared context runs once an add or commit is visible here (None: not shared): an
        uncommitted bundle is staged on the remote; a committed one is pushed, its staged manifest then
        removed. A keyed add (:meth:`_publish_keyed`) claims its key on the remote before anything else."""
        if not ctx.shared:
            return None

        def publish(bundle: Bundle, made: bool, commit: bool = False, request: str = "") -> Bundle:
            if request and bundle.idempotency_key:
                return self._publish_keyed(ctx, bundle, commit, request)
            if bundle.remote_url is not None and bundle.remote_url == ctx.remote_url:
                return bundle  # on the remote already (staged or pushed, or pulled from it)
            if not bundle.committed:
                return self._stage(ctx, bundle)
            [pushed] = self._sync.push(ctx, self._context_remote(ctx), bundle.uuid, unstage=not made)
            return pushed

        return publish

    def _publish_keyed(self, ctx: ContextState, bundle: Bundle, commit: bool, request: str) -> Bundle:
        """An add with an idempotency key in a shared context, visible here uncommitted (``bundle``: its
        own, or the one an earlier add of the key made). The key's uuid is staged on the remote with
        create-if-absent, so of two stores adding the key at once the first staged is the key's bundle
        on both; an add whose ``request`` (its digest) is not that bundle's is refused, one that is gets
        it, committed (and pushed) if it asked or if it was.

        Raises: AlreadyExists (the key's bundle was asked for with other content), DataLoss, Unavailable.
        """
        if bundle.remote_url != ctx.remote_url:
            bundle = self._stage(ctx, bundle)
        check_same_request(bundle, request)
        if (commit or bundle.committed) and not (bundle.committed and bundle.remote_url == ctx.remote_url):
            return self._commit(ctx, bundle.uuid)
        return bundle

    def _stage(self, ctx: ContextState, bundle: Bundle) -> Bundle:
        """Stage a bundle of a shared context on its remote (:meth:`RemoteSync.stage`) and record what
        is staged: this store's bundle, or the one another store staged first under its uuid (its
        files held here only if its content is this one's). A bundle committed here keeps that state,
        with no ``remote_url`` (its commit is still to be pushed). Raises: DataLoss, Unavailable."""
        remote = self._context_remote(ctx)
        self._sync.upload_blobs(ctx, remote, bundle)
        with ctx.pull_lock:  # a concurrent merge must not take it for a staged bundle since removed
            staged = self._sync.stage(ctx, remote, bundle)
            with ctx.lock:
                current = ctx.bundles.get(bundle.uuid)
                if current is None:
                    return staged  # deleted here meanwhile
                record = staged.with_state(
                    context=ctx.id, localized=current.localized and staged.content_hash == current.content_hash,
                    remote_url=remote.url)
                if current.committed and not staged.committed:
                    record = record.with_state(committed=True, commit_time=current.commit_time, remote_url=None)
                if staged is not bundle:
                    log.info("context %s: bundle %s was staged by another store first; this store's add of it "
                             "is that one", ctx.id, label(bundle))
                ctx.record(record)
        return record

    def _context(self, context_id: str) -> ContextState:
        self._check_open()
        validate_context_id(context_id)
        with self._lock:
            ctx = self._contexts.get(context_id)
        if ctx is None:
            raise NotFound(f"context {context_id!r} does not exist (contexts/{context_id})")
        return ctx

    def _remote(self, url: str) -> S3Remote:
        if self._s3 is None:
            raise FailedPrecondition(f"the remote {url} cannot be used: this bundle store has no S3 client")
        return S3Remote(self._s3, url)

    def _shows_change(self, intent: Intent) -> bool | None:
        """Whether the store shows the change an announcement was written ahead of (its recovery)."""
        ctx = self._contexts.get(intent.context)
        bundle = ctx.bundles.get(intent.uuid) if ctx is not None else None
        if intent.kind == COMMITTED:
            return bundle is not None and bundle.committed
        if intent.kind == PUSHED:
            return bundle is not None and bundle.remote_url == intent.remote_url
        if intent.kind == DELETED and intent.remote_url:  # a bundle that was only on the remote
            try:
                return not any(m.uuid == intent.uuid for m in self._remote(intent.remote_url).list_manifests())
            except (OpmlError, OSError):
                return None  # the remote is unreachable now: the next start decides
        return intent.kind == DELETED and bundle is None

    def _context_remote(self, ctx: ContextState) -> S3Remote:
        url = ctx.remote_url
        if url is None:
            raise FailedPrecondition(
                f"context {ctx.id!r} has no remote: bind one with set_remote(context_id, 's3://bucket/prefix')"
            )
        return self._remote(url)

    # -- adding --------------------------------------------------------------------------------

    def new_bundle(
        self,
        context_id: str,
        bundle_name: str,
        *,
        tags: dict[str, str] | None = None,
        values: dict[str, Value] | None = None,
        lineage: Lineage | None = None,
        idempotency_key: str = "",
    ) -> BundleWriter:
        """Start adding a new version of ``bundle_name``; nothing is visible until ``finish()``.
        With ``idempotency_key``, an add of the same name and key made before (here, or in a shared
        context by any store: its manifest carries the key) is what ``finish()`` returns when this add
        asks for the same content, and ``finish()`` raises AlreadyExists when not. In a shared context,
        the key also makes the uuid (every store adding the name with that key picks the same), so two
        stores adding it at the same moment stage one bundle, the first staged (:meth:`_publish_keyed`).

        Raises: InvalidArgument (name, tags, values, lineage, idempotency_key), NotFound (context),
        Unavailable (a shared context's remote, read for an earlier add of the key).
        """
        ctx = self._context(context_id)
        validate_bundle_name(bundle_name)
        key = validate_idempotency_key(idempotency_key)
        writer_args = dict(tags=validate_string_map(tags, "tags"), values=validate_values(values),
                           lineage=validate_lineage(lineage))
        if key:
            self._merge_remote(ctx, bundle_name)
        uuid = str(uuid_mod.uuid5(_KEYED_UUIDS, f"{ctx.id}/{bundle_name}/{key}")) if key and ctx.shared else None
        return BundleWriter(ctx, bundle_name, events=self._events, idempotency_key=key, uuid=uuid,
                            publish=self._write_through(ctx), **writer_args)

    # -- reading -------------------------------------------------------------------------------

    def list_bundles(
        self,
        context_id: str,
        *,
        bundle_name: str | None = None,
        tags: dict[str, str] | None = None,
        committed_only: bool = False,
        latest_only: bool = False,
    ) -> list[Bundle]:
        """Bundles of the context, newest first, filtered by name, tags (all must match) and
        committed state; ``latest_only`` keeps, per name, the version ``get_bundle(name)`` would
        pick among those that pass the filters.

        Raises: InvalidArgument, NotFound.
        """
        ctx = self._context(context_id)
        if bundle_name:
            validate_bundle_name(bundle_name)
        wanted = validate_string_map(tags, "tags")
        self._merge_remote(ctx, bundle_name or None)
        with ctx.lock:
            bundles = list(ctx.bundles.values())
        selected = [
            bundle for bundle in bundles
            if (not bundle_name or bundle.name == bundle_name)
            and (not committed_only or bundle.committed)
            and all(bundle.tags.get(key) == value for key, value in wanted.items())
        ]
        if latest_only:
            by_name: dict[str, list[Bundle]] = {}
            for bundle in selected:
                by_name.setdefault(bundle.name, []).append(bundle)
            selected = [latest_version(versions) for versions in by_name.values()]
        return sorted(selected, key=age, reverse=True)

    def get_bundle(self, context_id: str, ref: str) -> Bundle:
        """A bundle by uuid, or by name: its latest committed version, else its latest version
        (in a shared context, of the remote's versions too).

        Raises: InvalidArgument, NotFound, Unavailable (a shared context's remote).
        """
        return self._resolve(self._context(context_id), ref)

    def _resolve(self, ctx: ContextState, ref: str, *, prefer_committed: bool = True) -> Bundle:
        """``ctx.resolve``, after merging what a shared context's remote holds of ``ref`` (a committed
        uuid held here needs nothing: a version never changes after its commit; an uncommitted one is
        looked up among its name's, as any store may have committed it)."""
        if ctx.shared:
            with ctx.lock:
                held = ctx.bundles.get(ref) if is_uuid(ref) else None
            if held is None or not held.committed:
                if isinstance(ref, str) and ref and not is_uuid(ref):
                    validate_bundle_name(ref, "ref")
                self._merge_remote(ctx, held.name if held is not None else None if is_uuid(ref) else ref)
        with ctx.lock:
            return ctx.resolve(ref, prefer_committed=prefer_committed)

    def open_file(self, context_id: str, ref: str, path: str, *, chunk_size: int = READ_CHUNK) -> Iterator[bytes]:
        """The bytes of one file in chunks, verified against its sha256 as they are read.

        The last chunk is held back until the whole file matched its size and sha256, so a reader
        that got every chunk without an error got the right bytes; a mismatch raises DataLoss.

        Raises (on the call): InvalidArgument, NotFound (context, bundle, file),
        FailedPrecondition (the bundle is not localized), DataLoss (the blob is missing).
        Raises (while iterating): DataLoss.
        """
        ctx = self._context(context_id)
        validate_bundle_path(path)
        check_int("chunk_size", chunk_size, 1, 64 * MIB)
        bundle = self._resolve(ctx, ref)
        if ctx.shared and not bundle.localized and bundle.file(path) is not None:  # fetched on first read
            self._sync.pull(ctx, self._context_remote(ctx), bundle.name, localize=True, only_uuid=bundle.uuid)
            with ctx.lock:
                bundle = ctx.bundles.get(bundle.uuid, bundle)
        entry = bundle.file(path)
        if entry is None:
            raise NotFound(f"file {path!r} is not in bundle {label(bundle)} of context {ctx.id!r}")
        if not bundle.localized:
            raise FailedPrecondition(
                f"bundle {label(bundle)} is not localized (only its metadata was pulled): "
                f"pull it with localize=True before reading {path!r}"
            )
        try:
            handle = open(ctx.dir.blob_path(entry.sha256), "rb")  # noqa: SIM115 - closed by the generator
        except FileNotFoundError:
            raise DataLoss(
                f"bundle {label(bundle)}: the blob {entry.sha256} of file {path!r} is missing from the local store"
            ) from None
        return _verified_chunks(handle, bundle, entry, chunk_size)

    # -- committing ----------------------------------------------------------------------------

    def commit(self, context_id: str, ref: str) -> Bundle:
        """Mark a bundle committed (immutable, pushable). A name means its newest version.
        Idempotent: committing a committed bundle returns it unchanged. Every call announces the
        bundle (BundleCommitted), a repeated one too, so a commit can be announced again; consumers
        deduplicate by uuid.

        Raises: InvalidArgument, NotFound, OSError (the event could not be recorded; the bundle
        is committed).
        """
        ctx = self._context(context_id)
        self._resolve(ctx, ref, prefer_committed=False)  # a shared context: the remote's versions too
        return self._commit(ctx, ref)

    def _commit(self, ctx: ContextState, ref: str) -> Bundle:
        """:meth:`commit` of a bundle ``ctx`` holds (a shared context's: pushed, its staging removed)."""
        with ctx.lock:
            committed = ctx.resolve(ref, prefer_committed=False)
            if not committed.committed:  # no remote_url: a shared context's commit is still to be pushed
                committed = committed.with_state(committed=True, commit_time=ctx.next_time(), remote_url=None)
                intent = self._events.committing(committed)
                ctx.record(committed)
            else:
                intent = self._events.committing(committed)  # announced again: nothing to write ahead of
        self._events.announce(intent)
        write_through = self._write_through(ctx)
        if write_through is not None:
            committed = write_through(committed, False)
        return committed

    # -- push ----------------------------------------------------------------------------------

    def push(
        self, context_id: str, ref: str | None = None, progress: ProgressCallback | None = None,
    ) -> list[Bundle]:
        """Push committed bundles to the context's remote: their blobs (missing ones only, in
        parallel, big ones as resumable multipart uploads), then their manifests, signed.

        With ``ref``, that bundle is pushed (again, if it was: missing blobs are restored and its
        manifest is signed again, which is how a manifest pushed before signatures gets one). Without,
        every committed bundle not yet on the current remote is pushed (except bundles pulled
        without their files from another remote: skipped with a warning). ``progress`` is called on
        the calling thread with blobs and bytes confirmed on the remote. Each pushed bundle is
        announced (BundlePushed).

        Returns the pushed bundles (oldest first), with ``remote_url`` set.

        Raises: InvalidArgument, NotFound, FailedPrecondition (no remote, bundle not committed or
        not localized), DataLoss (a local blob is missing or truncated), Unavailable.
        """
        ctx = self._context(context_id)
        return self._sync.push(ctx, self._context_remote(ctx), ref, progress)

    # -- pull ----------------------------------------------------------------------------------

    def pull(
        self,
        context_id: str,
        bundle_name: str | None = None,
        *,
        localize: bool = False,
        progress: ProgressCallback | None = None,
    ) -> list[Bundle]:
        """Pull bundle manifests from the context's remote (all, or the versions of one name);
        with ``localize``, also download and verify their files (and those of bundles pulled
        earlier without files). Nothing is recorded unless every blob verified. A remote manifest
        that fails verification (a non-canonical UUID, a missing or invalid signature, a name, path
        or hash breaking the rules, a wrong content hash) is logged, passed to ``on_rejected_manifest``
        and skipped; the rest pull.

        Returns the bundles this pull added or localized, newest first.

        Raises: InvalidArgument, NotFound, FailedPrecondition (no remote), DataLoss (a remote
        blob does not match its hash, or is missing), Unavailable.
        """
        ctx = self._context(context_id)
        if bundle_name:
            validate_bundle_name(bundle_name)
        return self._sync.pull(ctx, self._context_remote(ctx), bundle_name, localize=localize, progress=progress)

    # -- delete and gc -------------------------------------------------------------------------

    def delete_bundle(self, context_id: str, ref: str, *, remote: bool = False) -> list[str]:
        """Delete a bundle's manifest (its blobs stay until ``gc``); with ``remote``, its manifest
        on the context's remote too (first, so a failure leaves the local copy). A uuid that is
        only on the remote can be deleted there with ``remote=True``. Each deleted bundle is
        announced (BundleDeleted).

        Returns the deleted uuids.

        Raises: InvalidArgument, NotFound, FailedPrecondition (remote=True without a remote),
        Unavailable.
        """
        ctx = self._context(context_id)
        s3_remote = self._context_remote(ctx) if remote else None
        with ctx.lock:
            try:
                bundle: Bundle | None = ctx.resolve(ref)
            except NotFound:
                if s3_remote is None or not is_uuid(ref):
                    raise
                bundle = None
        if bundle is None:
            assert s3_remote is not None
            listed = [m for m in s3_remote.list_manifests(staged=True) if m.uuid == ref]
            if not listed:
                raise NotFound(f"bundle {ref!r} exists neither in context {ctx.id!r} nor on {s3_remote.url}")
            intent = self._events.deleting(ctx.id, ref, listed[0].bundle_name, {}, remote=True,
                                           only_remote=s3_remote.url)
            try:
                s3_remote.delete([m.key for m in listed])
            except BaseException:
                self._events.settle(intent, self._shows_change)  # announced only if it went anyway
                raise
            self._events.announce(intent)
            return [ref]
        intent = self._events.deleting(ctx.id, bundle.uuid, bundle.name, bundle.tags, remote=remote)
        if s3_remote is not None:
            try:
                s3_remote.delete([s3_remote.manifest_key(bundle.name, bundle.uuid),
                                  s3_remote.staged_key(bundle.name, bundle.uuid)])
            except BaseException:
                self._events.settle(intent, self._shows_change)  # the local copy stays: dropped
                raise
        with ctx.lock:
            ctx.forget(bundle.uuid)
        log.info("deleted bundle %s from %s%s", label(bundle), ctx.id, " and its remote" if remote else "")
        self._events.announce(intent)
        return [bundle.uuid]

    def gc(self, context_id: str, *, remote: bool = False, grace_s: float = 3600, dry_run: bool = False) -> GcReport:
        """Remove blobs that no manifest references and that are older than ``grace_s`` seconds
        (so blobs of adds, pulls and pushes in flight survive). Locally, or on the context's
        remote with ``remote`` (where multipart uploads older than the grace are also aborted, and
        staged manifests of bundles committed since, or uncommitted for longer than the store's
        ``staging_ttl_s``, removed).

        Raises: InvalidArgument, NotFound, FailedPrecondition (remote=True without a remote),
        DataLoss (a remote manifest is unreadable: nothing is removed), Unavailable.
        """
        ctx = self._context(context_id)
        if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or not grace_s >= 0:
            raise InvalidArgument("grace_s", f"`grace_s` must be a number >= 0, but got {grace_s!r}.")
        if remote:
            return gc.collect_remote(ctx, self._context_remote(ctx), self._sync.fetch_manifests, grace_s=grace_s,
                                     staging_ttl_s=self._staging_ttl_s, dry_run=dry_run)
        return gc.collect_local(ctx, grace_s=grace_s, dry_run=dry_run)

    # -- upload grants -------------------------------------------------------------------------

    def revoke_upload_grant(self, context_id: str, grant_id: str) -> datetime:
        """Record that the upload grant ``grant_id`` of ``context_id`` is revoked, where every store
        serving the context looks at each of its holder's calls (:meth:`upload_grant_revoked`): on the
        remote of a shared context (``grants/revoked/<id>``), and in the context's directory. Revoking it
        again changes nothing. Returns when it was first revoked (here, or by another store).

        Raises: InvalidArgument (``grant_id``), NotFound (context), Unavailable (a shared context's remote).
        """
        ctx = self._context(context_id)
        validate_grant_id(grant_id)
        path = ctx.dir.revoked_grant_path(grant_id)
        with ctx.lock:
            if path.exists():  # revoked here before (on the remote first, if shared)
                ctx.revoked_grants.add(grant_id)
                return _revoke_time(path.read_bytes())
        revoked_at = None
        if ctx.shared:
            remote = self._context_remote(ctx)
            key = remote.revoked_grant_key(grant_id)
            if remote.stat(key) is not None:  # revoked by another store: its time
                record = bytearray()
                remote.read_into(key, record.extend, length=4096)  # a revocation is ~80 bytes
                revoked_at = _revoke_time(bytes(record))
            else:
                revoked_at = now()
                remote.put_bytes(key, _revocation(grant_id, revoked_at), sha256=None, content_type="application/json")
        with ctx.lock:
            if path.exists():  # revoked here meanwhile
                revoked_at = _revoke_time(path.read_bytes())
            else:
                revoked_at = revoked_at or now()
                path.parent.mkdir(exist_ok=True)
                atomic_write(path, _revocation(grant_id, revoked_at))
            ctx.revoked_grants.add(grant_id)
        log.info("context %s: upload grant %s revoked", ctx.id, grant_id)
        self._forget_expired_revocations(ctx)
        return revoked_at

    def _forget_expired_revocations(self, ctx: ContextState) -> None:
        """Remove the context's revocations made longer ago than a grant may live (``MAX_TTL_S``): the
        grants they revoke have expired, and an expired grant is refused anyway. Done at each revocation
        (the store keeps no list of grants, so when it was revoked is all it knows of a grant's expiry):
        here, and on a shared context's remote. A remote that fails leaves them to the next revocation."""
        expired = now() - timedelta(seconds=MAX_TTL_S)
        with ctx.lock:
            for path in ctx.dir.revoked_grants.iterdir():
                if _revoked_before(path.read_bytes(), expired):
                    path.unlink()
                    ctx.revoked_grants.discard(path.name)
        if not ctx.shared:
            return
        try:
            remote = self._context_remote(ctx)
            stale = []
            for obj in remote.list_objects(remote.revoked_grants_prefix):
                record = bytearray()
                remote.read_into(obj.key, record.extend, length=4096)  # a revocation is ~80 bytes
                if _revoked_before(bytes(record), expired):
                    stale.append(obj.key)
            if stale:
                remote.delete(stale)
        except OpmlError as exc:
            log.warning("context %s: expired upload grant revocations left on its remote: %s", ctx.id, exc)

    def upload_grant_revoked(self, context_id: str, grant_id: str) -> bool:
        """Whether the upload grant ``grant_id`` of ``context_id`` was revoked, by any store serving the
        context: a shared context's remote is asked each time (one HEAD) until it says so, which is then
        remembered (a revocation is for good).

        Raises: InvalidArgument, NotFound (context), Unavailable (a shared context's remote).
        """
        ctx = self._context(context_id)
        validate_grant_id(grant_id)
        with ctx.lock:
            if grant_id in ctx.revoked_grants:
                return True
            revoked = ctx.dir.revoked_grant_path(grant_id).exists()
        if not revoked and ctx.shared:
            remote = self._context_remote(ctx)
            revoked = remote.stat(remote.revoked_grant_key(grant_id)) is not None
        if revoked:
            with ctx.lock:
                ctx.revoked_grants.add(grant_id)
        return revoked

    # -- lineage -------------------------------------------------------------------------------

    def lineage(
        self, context_id: str, ref: str, *, upstream: bool = True, downstream: bool = True, max_depth: int = 10,
    ) -> LineageGraph:
        """The lineage graph around a bundle: its inputs (upstream) and their inputs, and the
        bundles that consumed it (downstream) and their consumers, up to ``max_depth`` hops each
        way (0: the bundle alone). Edges to inputs that are not in the context are kept.

        Raises: InvalidArgument, NotFound.
        """
        ctx = self._context(context_id)
        check_int("max_depth", max_depth, 0, 10_000)
        self._merge_remote(ctx)
        with ctx.lock:
            start = ctx.resolve(ref)
            bundles = dict(ctx.bundles)
        return lineage_graph(bundles, start, upstream=upstream, downstream=downstream, max_depth=max_depth)


# ----------------------------------------------------------------------------------------------


def _revocation(grant_id: str, revoked_at: datetime) -> bytes:
    return json.dumps({"grant_id": grant_id, "revoke_time": revoked_at.isoformat()}).encode()


def _revoked_before(record: bytes, moment: datetime) -> bool:
    """Whether a revocation record was made before ``moment`` (a corrupt one is kept: it says nothing)."""
    try:
        return _revoke_time(record) < moment
    except DataLoss:
        return False


def _revoke_time(record: bytes) -> datetime:
    """When a revocation (:func:`_revocation`) was made. Raises DataLoss when it is no revocation."""
    try:
        return datetime.fromisoformat(json.loads(record)["revoke_time"])
    except (ValueError, KeyError, TypeError) as exc:
        raise DataLoss(f"an upload grant's revocation record is corrupt: {exc}") from None


def _verified_chunks(handle: Any, bundle: Bundle, entry: FileEntry, chunk_size: int) -> Iterator[bytes]:
    with handle:
        hasher = hashlib.sha256()
        size = 0
        pending = handle.read(chunk_size)
        while pending:
            hasher.update(pending)
            size += len(pending)
            following = handle.read(chunk_size)
            if not following:
                break
            yield pending
            pending = following
        actual = hasher.hexdigest()
        if actual != entry.sha256 or size != entry.size:
            raise DataLoss(
                f"bundle {label(bundle)}: file {entry.path!r} is corrupt in the local store: expected sha256 "
                f"{entry.sha256} ({entry.size} bytes), but read sha256 {actual} ({size} bytes)"
            )
        if pending:
            yield pending
