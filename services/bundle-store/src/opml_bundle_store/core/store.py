"""The bundle store: contexts of bundles on local disk, pushed to and pulled from S3.

This is the transport-free core of the bundle-store service: the gRPC servicer converts messages
and calls these methods (through ``asyncio.to_thread``), and every method is safe to call from many
threads at once. Failures are platform errors (:mod:`opml_common.errors`):

* :class:`InvalidArgument` - an argument breaks a rule (the field is named, the value shown);
* :class:`NotFound` - the context, bundle or file does not exist;
* :class:`AlreadyExists` - ``create_context`` of an existing id;
* :class:`FailedPrecondition` - the state forbids the call (push without a remote, push of an
  uncommitted bundle, reading a file that was not pulled, a home used by another process);
* :class:`DataLoss` - stored bytes do not match their sha256 (locally or on the remote);
* :class:`Unavailable` - S3 cannot be reached right now (retriable).

Durability: a bundle becomes visible only when its manifest is renamed into place, after its
blobs are durable; a crash mid-add leaves staging files that the next open removes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import mimetypes
import os
import shutil
import threading
import uuid as uuid_mod
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from minio import Minio
from opml_common.errors import AlreadyExists, DataLoss, FailedPrecondition, InvalidArgument, NotFound

from opml_bundle_store.core.layout import ContextDir, atomic_write, fsync_dir, make_durable
from opml_bundle_store.core.model import (
    DEFAULT_MEDIA_TYPE,
    Bundle,
    ContextInfo,
    FileEntry,
    GcReport,
    Lineage,
    LineageGraph,
    TransferProgress,
    Value,
    compute_content_hash,
    is_uuid,
    normalize_remote_url,
    validate_bundle_name,
    validate_bundle_path,
    validate_context_id,
    validate_lineage,
    validate_media_type,
    validate_sha256,
    validate_string_map,
    validate_values,
)
from opml_bundle_store.core.remote import MANIFEST_CONTENT_TYPE, S3Remote
from opml_bundle_store.core.transfer import (
    BlobRef,
    Downloader,
    ProgressReporter,
    TaskRunner,
    TransferSettings,
    Uploader,
)

log = logging.getLogger(__name__)

MIB = 1024 * 1024
S3_MIN_PART_SIZE = 5 * MIB
S3_MAX_PART_SIZE = 5 * 1024 * MIB
READ_CHUNK = 1 * MIB

ProgressCallback = Callable[[TransferProgress], None]


def _now() -> datetime:
    return datetime.now(UTC)


def _label(bundle: Bundle) -> str:
    return f"{bundle.name!r} ({bundle.uuid})"


class _Context:
    """In-memory state of one context. ``lock`` guards ``bundles`` and the context's files."""

    def __init__(self, context_id: str, directory: ContextDir, remote_url: str | None) -> None:
        self.id = context_id
        self.dir = directory
        self.remote_url = remote_url
        self.lock = threading.RLock()
        self.push_lock = threading.Lock()
        self.pull_lock = threading.Lock()
        self.bundles: dict[str, Bundle] = {}
        self.last_time: datetime | None = None

    def info(self) -> ContextInfo:
        with self.lock:
            return ContextInfo(self.id, self.remote_url, len(self.bundles))

    def next_time(self) -> datetime:
        """Now, but strictly after every time this context handed out (so newest-first is total)."""
        now = _now()
        if self.last_time is not None and now <= self.last_time:
            now = self.last_time + timedelta(microseconds=1)
        self.last_time = now
        return now


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

    Raises:
        InvalidArgument: a setting is out of range.
        FailedPrecondition: another process holds ``home``.
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
    ) -> None:
        _check_int("transfer_workers", transfer_workers, 1, 256)
        _check_int("part_size", part_size, S3_MIN_PART_SIZE, S3_MAX_PART_SIZE,
                   "(S3 refuses parts under 5 MiB)")
        _check_int("multipart_threshold", multipart_threshold, S3_MIN_PART_SIZE, 5 * 1024 * 1024 * MIB)
        _check_int("upload_streams", upload_streams, 1, 256)
        _check_int("download_streams", download_streams, 1, 256)
        _check_int("range_size", range_size, MIB, S3_MAX_PART_SIZE)
        self.home = Path(home)
        self._s3 = s3
        self._settings = TransferSettings(
            part_size=part_size, multipart_threshold=multipart_threshold, max_in_flight=transfer_workers,
            upload_streams=min(upload_streams, transfer_workers),
            download_streams=min(download_streams, transfer_workers), range_size=range_size,
        )
        self._contexts_dir = self.home / "contexts"
        self._contexts_dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = self._acquire_home()
        self._lock = threading.RLock()
        self._contexts: dict[str, _Context] = {}
        self._closed = False
        try:
            self._open_contexts()
        except BaseException:
            self._lock_file.close()
            raise
        self._pool = ThreadPoolExecutor(transfer_workers, thread_name_prefix="bundle-store-xfer")

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the transfer threads and release ``home``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._lock_file.close()

    def __enter__(self) -> BundleStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _acquire_home(self) -> Any:
        handle = open(self.home / ".lock", "a+b")  # noqa: SIM115 - held for the store's lifetime
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise FailedPrecondition(
                f"the bundle store home {str(self.home)!r} is in use by another BundleStore "
                "(one process, one open store per home): close it first"
            ) from None
        return handle

    def _open_contexts(self) -> None:
        for leftover in self._contexts_dir.glob(".tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        for root in sorted(self._contexts_dir.iterdir()):
            if not root.is_dir() or root.name.startswith("."):
                continue
            directory = ContextDir(root)
            try:
                settings = json.loads(directory.context_file.read_bytes())
                context_id = validate_context_id(settings["id"])
                remote_url = normalize_remote_url(settings.get("remote_url"))
            except (OSError, ValueError, KeyError, TypeError, InvalidArgument) as exc:
                log.error("skipping %s: not a readable context (%s)", root, exc)
                continue
            directory.create_dirs()
            removed = directory.recover()
            if removed:
                log.warning("context %s: removed %d leftovers of unfinished adds and pulls", context_id, removed)
            ctx = _Context(context_id, directory, remote_url)
            for manifest in directory.bundles.glob("*.json"):
                try:
                    bundle = Bundle.from_json(manifest.read_bytes(), context=context_id)
                except (OSError, ValueError) as exc:
                    log.error("context %s: skipping the unreadable manifest %s (%s)", context_id, manifest, exc)
                    continue
                ctx.bundles[bundle.uuid] = bundle
                for time in (bundle.create_time, bundle.commit_time):
                    if time is not None and (ctx.last_time is None or time > ctx.last_time):
                        ctx.last_time = time
            self._contexts[context_id] = ctx

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
            ctx = _Context(context_id, ContextDir(self._contexts_dir / context_id), url)
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

    def _context(self, context_id: str) -> _Context:
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

    def _context_remote(self, ctx: _Context) -> S3Remote:
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
    ) -> BundleWriter:
        """Start adding a new version of ``bundle_name``; nothing is visible until ``finish()``.

        Raises: InvalidArgument (name, tags, values, lineage), NotFound (context).
        """
        ctx = self._context(context_id)
        validate_bundle_name(bundle_name)
        return BundleWriter(
            self, ctx, bundle_name,
            tags=validate_string_map(tags, "tags"),
            values=validate_values(values),
            lineage=validate_lineage(lineage),
        )

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
            selected = [_latest(versions) for versions in by_name.values()]
        return sorted(selected, key=_age, reverse=True)

    def get_bundle(self, context_id: str, ref: str) -> Bundle:
        """A bundle by uuid, or by name: its latest committed version, else its latest version.

        Raises: InvalidArgument, NotFound.
        """
        ctx = self._context(context_id)
        with ctx.lock:
            return self._resolve(ctx, ref)

    def _resolve(self, ctx: _Context, ref: str, *, prefer_committed: bool = True) -> Bundle:
        if not isinstance(ref, str) or not ref:
            raise InvalidArgument("ref", f"`ref` must be a bundle uuid or bundle name, but got {ref!r}.")
        found = ctx.bundles.get(ref)
        if found is not None:
            return found
        if not is_uuid(ref):
            validate_bundle_name(ref, "ref")
        versions = [bundle for bundle in ctx.bundles.values() if bundle.name == ref]
        if not versions:
            kind = "uuid or name" if is_uuid(ref) else "name"
            raise NotFound(f"bundle {ref!r} does not exist in context {ctx.id!r} (no bundle has that {kind})")
        return _latest(versions) if prefer_committed else max(versions, key=_age)

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
        _check_int("chunk_size", chunk_size, 1, 64 * MIB)
        with ctx.lock:
            bundle = self._resolve(ctx, ref)
        entry = bundle.file(path)
        if entry is None:
            raise NotFound(f"file {path!r} is not in bundle {_label(bundle)} of context {ctx.id!r}")
        if not bundle.localized:
            raise FailedPrecondition(
                f"bundle {_label(bundle)} is not localized (only its metadata was pulled): "
                f"pull it with localize=True before reading {path!r}"
            )
        try:
            handle = open(ctx.dir.blob_path(entry.sha256), "rb")  # noqa: SIM115 - closed by the generator
        except FileNotFoundError:
            raise DataLoss(
                f"bundle {_label(bundle)}: the blob {entry.sha256} of file {path!r} is missing from the local store"
            ) from None
        return _verified_chunks(handle, bundle, entry, chunk_size)

    # -- committing ----------------------------------------------------------------------------

    def commit(self, context_id: str, ref: str) -> Bundle:
        """Mark a bundle committed (immutable, pushable). A name means its newest version.
        Idempotent: committing a committed bundle returns it unchanged.

        Raises: InvalidArgument, NotFound.
        """
        ctx = self._context(context_id)
        with ctx.lock:
            bundle = self._resolve(ctx, ref, prefer_committed=False)
            if bundle.committed:
                return bundle
            committed = bundle.with_state(committed=True, commit_time=ctx.next_time())
            self._write_record(ctx, committed)
            return committed

    def _write_record(self, ctx: _Context, bundle: Bundle) -> None:
        """Persist a bundle's manifest with its local state and update the index (ctx.lock held)."""
        atomic_write(ctx.dir.manifest_path(bundle.uuid), bundle.to_json())
        ctx.bundles[bundle.uuid] = bundle

    # -- push ----------------------------------------------------------------------------------

    def push(
        self, context_id: str, ref: str | None = None, progress: ProgressCallback | None = None,
    ) -> list[Bundle]:
        """Push committed bundles to the context's remote: their blobs (missing ones only, in
        parallel, big ones as resumable multipart uploads), then their manifests.

        With ``ref``, that bundle is pushed (again, if it was: missing blobs are restored). Without,
        every committed bundle not yet on the current remote is pushed (except bundles pulled
        without their files from another remote: skipped with a warning). ``progress`` is called on
        the calling thread with blobs and bytes confirmed on the remote.

        Returns the pushed bundles (oldest first), with ``remote_url`` set.

        Raises: InvalidArgument, NotFound, FailedPrecondition (no remote, bundle not committed or
        not localized), DataLoss (a local blob is missing or truncated), Unavailable.
        """
        ctx = self._context(context_id)
        remote = self._context_remote(ctx)
        with ctx.push_lock:
            with ctx.lock:
                if ref is not None:
                    bundle = self._resolve(ctx, ref)
                    if not bundle.committed:
                        raise FailedPrecondition(
                            f"bundle {_label(bundle)} is not committed: commit it before pushing"
                        )
                    targets = [bundle]
                else:
                    targets = sorted(
                        (b for b in ctx.bundles.values() if b.committed and b.remote_url != remote.url), key=_age
                    )
                    skipped = [b for b in targets if not b.localized]
                    if skipped:
                        log.warning("push of %s skips %d bundles pulled without their files (first: %s); "
                                    "pull them with localize=True to push them to %s",
                                    ctx.id, len(skipped), _label(skipped[0]), remote.url)
                        targets = [b for b in targets if b.localized]
            for bundle in targets:
                if not bundle.localized:
                    raise FailedPrecondition(
                        f"bundle {_label(bundle)} is not localized, so its files cannot be pushed to "
                        f"{remote.url}: pull it with localize=True first"
                    )
            reporter = ProgressReporter(progress)
            blobs = _unique_blobs(targets)
            uploader = Uploader(remote, ctx.dir, self._pool, self._settings, reporter)
            stats = uploader.upload(blobs)
            self._put_manifests(remote, targets)
            pushed = []
            with ctx.lock:
                for bundle in targets:
                    current = ctx.bundles.get(bundle.uuid)
                    if current is None:  # deleted meanwhile
                        continue
                    if current.remote_url != remote.url:
                        current = current.with_state(remote_url=remote.url)
                        self._write_record(ctx, current)
                    pushed.append(current)
            reporter.emit(force=True)
        log.info("pushed %d bundles of %s to %s: %s", len(pushed), ctx.id, remote.url, stats)
        return pushed

    def _put_manifests(self, remote: S3Remote, bundles: list[Bundle]) -> None:
        runner = TaskRunner(self._pool, max_in_flight=self._settings.max_in_flight, max_heavy=1)
        for bundle in bundles:
            data = bundle.to_json(local_state=False)
            runner.add(lambda bundle=bundle, data=data: remote.put_bytes(
                remote.manifest_key(bundle.name, bundle.uuid), data,
                sha256=hashlib.sha256(data).hexdigest(), content_type=MANIFEST_CONTENT_TYPE,
            ))
        runner.run()

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
        earlier without files). Nothing is recorded unless every blob verified.

        Returns the bundles this pull added or localized, newest first.

        Raises: InvalidArgument, NotFound, FailedPrecondition (no remote), DataLoss (a remote
        manifest or blob does not match its hash), Unavailable.
        """
        ctx = self._context(context_id)
        if bundle_name:
            validate_bundle_name(bundle_name)
        remote = self._context_remote(ctx)
        with ctx.pull_lock:
            listed = remote.list_manifests(bundle_name or None)
            with ctx.lock:
                known = dict(ctx.bundles)
            fresh = self._fetch_manifests(ctx, remote, [m for m in listed if m.uuid not in known])
            to_localize: list[Bundle] = []
            if localize:
                to_localize = list(fresh) + [
                    known[m.uuid] for m in listed if m.uuid in known and not known[m.uuid].localized
                ]
            reporter = ProgressReporter(progress)
            needed = self._blobs_to_fetch(ctx, to_localize)
            stats = Downloader(remote, ctx.dir, self._pool, self._settings, reporter).download(needed)
            changed: list[Bundle] = []
            with ctx.lock:
                for bundle in fresh:
                    present = localize or all(ctx.dir.blob_path(f.sha256).exists() for f in bundle.files)
                    record = bundle.with_state(context=ctx.id, remote_url=remote.url, localized=present)
                    self._write_record(ctx, record)
                    changed.append(record)
                if localize:
                    for old in to_localize[len(fresh):]:
                        current = ctx.bundles.get(old.uuid)
                        if current is not None and not current.localized:
                            record = current.with_state(localized=True, remote_url=current.remote_url or remote.url)
                            self._write_record(ctx, record)
                            changed.append(record)
            reporter.emit(force=True)
        log.info("pulled %d bundles into %s from %s: %s", len(changed), ctx.id, remote.url, stats)
        return sorted(changed, key=_age, reverse=True)

    def _fetch_manifests(self, ctx: _Context, remote: S3Remote, listed: list[Any]) -> list[Bundle]:
        fetched: list[Bundle] = []
        runner = TaskRunner(self._pool, max_in_flight=self._settings.max_in_flight, max_heavy=1)
        for item in listed:
            runner.add(lambda item=item: _parse_remote_manifest(remote, item, ctx.id), on_done=fetched.append)
        runner.run()
        return fetched

    def _blobs_to_fetch(self, ctx: _Context, bundles: list[Bundle]) -> list[BlobRef]:
        """Blobs of ``bundles`` missing locally. Present ones are touched so a concurrent gc (which
        spares young unreferenced blobs) cannot remove them before the manifest is recorded."""
        needed: dict[str, BlobRef] = {}
        for bundle in bundles:
            for entry in bundle.files:
                if entry.sha256 in needed:
                    continue
                try:
                    os.utime(ctx.dir.blob_path(entry.sha256))
                except FileNotFoundError:
                    needed[entry.sha256] = BlobRef(entry.sha256, entry.size, _label(bundle), entry.path)
        return list(needed.values())

    # -- delete and gc -------------------------------------------------------------------------

    def delete_bundle(self, context_id: str, ref: str, *, remote: bool = False) -> list[str]:
        """Delete a bundle's manifest (its blobs stay until ``gc``); with ``remote``, its manifest
        on the context's remote too (first, so a failure leaves the local copy). A uuid that is
        only on the remote can be deleted there with ``remote=True``.

        Returns the deleted uuids.

        Raises: InvalidArgument, NotFound, FailedPrecondition (remote=True without a remote),
        Unavailable.
        """
        ctx = self._context(context_id)
        s3_remote = self._context_remote(ctx) if remote else None
        with ctx.lock:
            try:
                bundle: Bundle | None = self._resolve(ctx, ref)
            except NotFound:
                if s3_remote is None or not is_uuid(ref):
                    raise
                bundle = None
        if bundle is None:
            assert s3_remote is not None
            keys = [m.key for m in s3_remote.list_manifests() if m.uuid == ref]
            if not keys:
                raise NotFound(f"bundle {ref!r} exists neither in context {ctx.id!r} nor on {s3_remote.url}")
            s3_remote.delete(keys)
            return [ref]
        if s3_remote is not None:
            s3_remote.delete([s3_remote.manifest_key(bundle.name, bundle.uuid)])
        with ctx.lock:
            if ctx.bundles.pop(bundle.uuid, None) is not None:
                ctx.dir.manifest_path(bundle.uuid).unlink(missing_ok=True)
                fsync_dir(ctx.dir.bundles)
        log.info("deleted bundle %s from %s%s", _label(bundle), ctx.id, " and its remote" if remote else "")
        return [bundle.uuid]

    def gc(self, context_id: str, *, remote: bool = False, grace_s: float = 3600, dry_run: bool = False) -> GcReport:
        """Remove blobs that no manifest references and that are older than ``grace_s`` seconds
        (so blobs of adds, pulls and pushes in flight survive). Locally, or on the context's
        remote with ``remote`` (where multipart uploads older than the grace are also aborted).

        Raises: InvalidArgument, NotFound, FailedPrecondition (remote=True without a remote),
        DataLoss (a remote manifest is unreadable: nothing is removed), Unavailable.
        """
        ctx = self._context(context_id)
        if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or not grace_s >= 0:
            raise InvalidArgument("grace_s", f"`grace_s` must be a number >= 0, but got {grace_s!r}.")
        if remote:
            return self._gc_remote(ctx, self._context_remote(ctx), grace_s, dry_run)
        return self._gc_local(ctx, grace_s, dry_run)

    def _gc_local(self, ctx: _Context, grace_s: float, dry_run: bool) -> GcReport:
        removed = freed = kept = 0
        with ctx.lock:
            referenced = {entry.sha256 for bundle in ctx.bundles.values() for entry in bundle.files}
            cutoff = _now().timestamp() - grace_s
            for sha, path, stat in list(ctx.dir.iter_blobs()):
                if sha in referenced or stat.st_mtime > cutoff:
                    kept += 1
                    continue
                if not dry_run:
                    path.unlink(missing_ok=True)
                    ctx.dir.upload_state_path(sha).unlink(missing_ok=True)
                removed += 1
                freed += stat.st_size
        log.info("gc %s (local%s): removed %d blobs, %d bytes; kept %d",
                 ctx.id, ", dry run" if dry_run else "", removed, freed, kept)
        return GcReport(removed, freed, kept)

    def _gc_remote(self, ctx: _Context, remote: S3Remote, grace_s: float, dry_run: bool) -> GcReport:
        with ctx.push_lock:  # this store's pushes cannot race with the listing below
            listed = remote.list_manifests()
            manifests = self._fetch_manifests(ctx, remote, listed)
            referenced = {entry.sha256 for bundle in manifests for entry in bundle.files}
            cutoff = _now() - timedelta(seconds=grace_s)
            doomed: list[str] = []
            removed = freed = kept = 0
            for sha, obj in remote.list_blobs().items():
                young = obj.last_modified is not None and obj.last_modified > cutoff
                if sha in referenced or young:
                    kept += 1
                    continue
                doomed.append(obj.key)
                removed += 1
                freed += obj.size
            if not dry_run:
                remote.delete(doomed)
                for upload in remote.list_uploads(remote.objects_prefix):
                    if upload.initiated is not None and upload.initiated < cutoff:
                        remote.abort_multipart(upload.key, upload.upload_id)
        log.info("gc %s (remote %s%s): removed %d blobs, %d bytes; kept %d",
                 ctx.id, remote.url, ", dry run" if dry_run else "", removed, freed, kept)
        return GcReport(removed, freed, kept)

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
        _check_int("max_depth", max_depth, 0, 10_000)
        with ctx.lock:
            start = self._resolve(ctx, ref)
            bundles = dict(ctx.bundles)
        found: dict[str, Bundle] = {start.uuid: start}
        edges: set[tuple[str, str]] = set()
        if upstream:
            frontier = [start]
            for _ in range(max_depth):
                next_frontier = []
                for bundle in frontier:
                    for input_uuid in bundle.lineage.input_uuids:
                        edges.add((input_uuid, bundle.uuid))
                        parent = bundles.get(input_uuid)
                        if parent is not None and parent.uuid not in found:
                            found[parent.uuid] = parent
                            next_frontier.append(parent)
                frontier = next_frontier
        if downstream:
            consumers: dict[str, list[Bundle]] = {}
            for bundle in sorted(bundles.values(), key=_age):
                for input_uuid in bundle.lineage.input_uuids:
                    consumers.setdefault(input_uuid, []).append(bundle)
            frontier = [start]
            for _ in range(max_depth):
                next_frontier = []
                for bundle in frontier:
                    for child in consumers.get(bundle.uuid, ()):
                        edges.add((bundle.uuid, child.uuid))
                        if child.uuid not in found:
                            found[child.uuid] = child
                            next_frontier.append(child)
                frontier = next_frontier
        return LineageGraph(tuple(found.values()), tuple(sorted(edges)))


# ----------------------------------------------------------------------------------------------


class BundleWriter:
    """Stages the files of a new bundle; ``finish()`` makes it visible atomically.

    Returned by :meth:`BundleStore.new_bundle`. As a context manager it aborts (removes every
    staged byte) when the block raises or ends without ``finish()``. One writer is meant for one
    thread at a time; different writers may run concurrently.
    """

    def __init__(
        self, store: BundleStore, ctx: _Context, name: str, *,
        tags: dict[str, str], values: dict[str, Value], lineage: Lineage,
    ) -> None:
        self._store = store
        self._ctx = ctx
        self.name = name
        self.uuid = str(uuid_mod.uuid4())
        self._tags = tags
        self._values = values
        self._lineage = lineage
        self._staging = ctx.dir.new_staging_dir()
        self._files: list[FileEntry] = []
        self._staged: list[Path] = []
        self._paths: set[str] = set()
        self._state = "open"
        self._lock = threading.Lock()

    def __enter__(self) -> BundleWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()

    @property
    def files(self) -> tuple[FileEntry, ...]:
        return tuple(self._files)

    def _check_open(self) -> None:
        if self._state != "open":
            raise FailedPrecondition(f"the writer of bundle {self.name!r} ({self.uuid}) is already {self._state}")

    def add_file(
        self,
        path: str,
        chunks: Iterable[bytes],
        *,
        media_type: str | None = None,
        expected_sha256: str | None = None,
        expected_size: int | None = None,
    ) -> FileEntry:
        """Stream one file into staging while hashing it.

        Raises:
            InvalidArgument: bad path (or already in the bundle), media type or expectation, a
                chunk that is not bytes, or content that does not match ``expected_size`` /
                ``expected_sha256`` (the message names the file; the file is dropped, the writer
                stays usable).
            FailedPrecondition: the writer is finished or aborted.
        """
        with self._lock:
            self._check_open()
            validate_bundle_path(path)
            if path in self._paths:
                raise InvalidArgument("path", f"`path` must be unique in a bundle, but {path!r} was already added.")
            media = DEFAULT_MEDIA_TYPE if media_type is None else validate_media_type(media_type)
            want_sha = None if expected_sha256 is None else validate_sha256(expected_sha256, "expected_sha256")
            if expected_size is not None:
                _check_int("expected_size", expected_size, 0, 2**63 - 1)
            staged = self._staging / f"{len(self._staged):07d}"
            hasher = hashlib.sha256()
            size = 0
            try:
                with open(staged, "wb") as out:
                    for chunk in chunks:
                        if not isinstance(chunk, (bytes, bytearray, memoryview)):
                            raise InvalidArgument(
                                "chunks", f"`chunks` of file {path!r} must be bytes, but got {type(chunk).__name__}."
                            )
                        hasher.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
                        if expected_size is not None and size > expected_size:
                            raise InvalidArgument(
                                "expected_size",
                                f"file {path!r}: `expected_size` is {expected_size} bytes, but more arrived.",
                            )
                digest = hasher.hexdigest()
                if expected_size is not None and size != expected_size:
                    raise InvalidArgument(
                        "expected_size", f"file {path!r}: `expected_size` is {expected_size} bytes, but got {size}."
                    )
                if want_sha is not None and digest != want_sha:
                    raise InvalidArgument(
                        "expected_sha256",
                        f"file {path!r}: `expected_sha256` is {want_sha}, but the content hashes to {digest}.",
                    )
            except BaseException:
                staged.unlink(missing_ok=True)
                raise
            entry = FileEntry(path, digest, size, media)
            self._files.append(entry)
            self._staged.append(staged)
            self._paths.add(path)
            return entry

    def add_path(self, source: Path, dest: str = "") -> list[FileEntry]:
        """Add a file (as ``dest``, default its name) or a directory tree (under ``dest``, default
        the bundle's root), in sorted order. Media types are guessed from file names.

        Raises: InvalidArgument (bad ``dest``, ``source`` missing or neither file nor
        directory), and what :meth:`add_file` raises.
        """
        source = Path(source)
        dest = dest.strip("/")
        if dest:
            validate_bundle_path(dest, "dest")
        if source.is_file():
            return [self._add_one(source, dest or source.name)]
        if not source.is_dir():
            raise InvalidArgument("source", f"`source` must be an existing file or directory, but got {str(source)!r}.")
        entries = []
        for root, dirs, names in os.walk(source):
            dirs.sort()
            for name in sorted(names):
                file_path = Path(root) / name
                if not file_path.is_file():
                    continue
                relative = file_path.relative_to(source).as_posix()
                entries.append(self._add_one(file_path, f"{dest}/{relative}" if dest else relative))
        return entries

    def _add_one(self, file_path: Path, path: str) -> FileEntry:
        media_type = mimetypes.guess_type(file_path.name)[0] or DEFAULT_MEDIA_TYPE
        with open(file_path, "rb") as handle:
            return self.add_file(path, iter(lambda: handle.read(READ_CHUNK), b""), media_type=media_type)

    def finish(self, *, commit: bool = False) -> Bundle:
        """Make the bundle visible: staged blobs move into the store (identical content is kept
        once), then the manifest is written atomically. With ``commit``, it is committed too.

        Raises: FailedPrecondition (already finished or aborted), OSError (disk). On failure the
        writer is aborted and nothing is visible.
        """
        with self._lock:
            self._check_open()
            self._state = "finishing"
        ctx = self._ctx
        try:
            make_durable(self._staged)
            with ctx.lock:
                touched: set[Path] = set()
                for entry, staged in zip(self._files, self._staged):
                    target = ctx.dir.blob_path(entry.sha256)
                    try:
                        os.utime(target)  # already stored: keep one copy, refresh it for gc
                        staged.unlink()
                        continue
                    except FileNotFoundError:
                        pass
                    target.parent.mkdir(exist_ok=True)
                    os.replace(staged, target)
                    touched.add(target.parent)
                for directory in touched:
                    fsync_dir(directory)
                now = ctx.next_time()
                bundle = Bundle(
                    context=ctx.id, name=self.name, uuid=self.uuid, tags=self._tags, files=tuple(self._files),
                    values=self._values, lineage=self._lineage,
                    content_hash=compute_content_hash(self._files, self._values),
                    committed=commit, create_time=now, commit_time=now if commit else None,
                    remote_url=None, localized=True,
                )
                self._store._write_record(ctx, bundle)
        except BaseException:
            self._state = "open"
            self.abort()
            raise
        shutil.rmtree(self._staging, ignore_errors=True)
        self._state = "finished"
        return bundle

    def abort(self) -> None:
        """Drop every staged file. Idempotent; a no-op after ``finish()``."""
        with self._lock:
            if self._state in ("finished", "aborted"):
                return
            self._state = "aborted"
        shutil.rmtree(self._staging, ignore_errors=True)


# ----------------------------------------------------------------------------------------------


def _check_int(field: str, value: Any, low: int, high: int, note: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidArgument(
            field, f"`{field}` must be an integer in [{low}, {high}]{' ' + note if note else ''}, but got {value!r}."
        )


def _age(bundle: Bundle) -> tuple[datetime, str]:
    return (bundle.create_time, bundle.uuid)


def _latest(versions: list[Bundle]) -> Bundle:
    committed = [bundle for bundle in versions if bundle.committed]
    return max(committed or versions, key=_age)


def _unique_blobs(bundles: list[Bundle]) -> list[BlobRef]:
    blobs: dict[str, BlobRef] = {}
    for bundle in bundles:
        for entry in bundle.files:
            blobs.setdefault(entry.sha256, BlobRef(entry.sha256, entry.size, _label(bundle), entry.path))
    return list(blobs.values())


def _parse_remote_manifest(remote: S3Remote, item: Any, context_id: str) -> Bundle:
    """Fetch and check one remote manifest: well-formed, named as its key, content hash right."""
    data = remote.get_bytes(item.key)
    where = f"the manifest {item.key!r} on {remote.url}"
    try:
        bundle = Bundle.from_json(data, context=context_id)
        validate_bundle_name(bundle.name)
        for entry in bundle.files:
            validate_bundle_path(entry.path)
            validate_sha256(entry.sha256)
    except (ValueError, InvalidArgument) as exc:
        raise DataLoss(f"{where} is corrupt: {exc}") from None
    if bundle.uuid != item.uuid or bundle.name != item.bundle_name:
        raise DataLoss(f"{where} describes bundle {bundle.name!r} ({bundle.uuid}), not the one its key names")
    actual = compute_content_hash(bundle.files, bundle.values)
    if actual != bundle.content_hash:
        raise DataLoss(f"{where} is corrupt: its content_hash is {bundle.content_hash}, but its files and "
                       f"values hash to {actual}")
    return bundle.with_state(committed=True, commit_time=bundle.commit_time or bundle.create_time)


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
                f"bundle {_label(bundle)}: file {entry.path!r} is corrupt in the local store: expected sha256 "
                f"{entry.sha256} ({entry.size} bytes), but read sha256 {actual} ({size} bytes)"
            )
        if pending:
            yield pending
