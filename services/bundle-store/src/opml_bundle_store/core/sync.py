"""Moving bundles between a context and its S3 remote: push (blobs, then signed manifests) and pull
(manifests, each verified against its signature first, then, to localize, blobs verified against
their sha256 before anything is recorded)."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from opml_bundle_store.core.context import ContextState
from opml_bundle_store.core.events import BundleEvents
from opml_bundle_store.core.manifest import Bundle, RejectedManifest, TransferProgress, age, compute_content_hash, label
from opml_bundle_store.core.remote import RemoteManifest, S3Remote
from opml_bundle_store.core.rules import INT64_MAX, INT64_MIN, is_uuid, validate_bundle_name
from opml_bundle_store.core.signing import ManifestKeys
from opml_bundle_store.core.transfer import (
    BlobRef,
    Downloader,
    ProgressReporter,
    TaskRunner,
    TransferSettings,
    Uploader,
)
from opml_bundle_store_contract.paths import path_violations
from opml_common.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound

log = logging.getLogger(__name__)

ProgressCallback = Callable[[TransferProgress], None]
_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
"""The largest remote manifest read (a bundle of ~300,000 files): a bigger object under a manifest key
is no manifest this store wrote, and is not read into memory to find out."""
RejectedCallback = Callable[[RejectedManifest], None]


class _Rejected(DataLoss):
    """A remote manifest that fails verification; ``reason`` is one of REJECT_REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RemoteSync:
    """Pushes and pulls of every context of one store, on the store's shared transfer threads.

    The store checks the arguments and finds the context and its remote; these methods take the
    context's push or pull lock for the whole transfer. ``keys`` sign the manifests a push writes
    and verify those a pull reads.
    """

    def __init__(self, pool: ThreadPoolExecutor, settings: TransferSettings, events: BundleEvents,
                 keys: ManifestKeys, on_rejected: RejectedCallback | None = None) -> None:
        self._pool = pool
        self._settings = settings
        self._events = events
        self._keys = keys
        self._on_rejected = on_rejected

    def push(self, ctx: ContextState, remote: S3Remote, ref: str | None = None,
             progress: ProgressCallback | None = None, *, unstage: bool = False) -> list[Bundle]:
        """Push committed bundles to the context's remote: their blobs (missing ones only, in
        parallel, big ones as resumable multipart uploads), then their manifests, signed.

        With ``ref``, that bundle is pushed (again, if it was: missing blobs are restored and the
        manifest is signed again with the current key). Without,
        every committed bundle not yet on the current remote is pushed (except bundles pulled
        without their files from another remote: skipped with a warning). ``progress`` is called on
        the calling thread with blobs and bytes confirmed on the remote. Each pushed bundle is
        announced (BundlePushed) once its manifest is on the remote, whether or not a caller waits.

        A shared context's bundles need not be localized: one this store holds without its files was
        staged or pulled through the context's remote, where its blobs are, so only its manifest is
        written. ``unstage``: the staged manifests of the pushed bundles (a shared context's uncommitted
        copies) are removed once the committed ones are written.

        Returns the pushed bundles (oldest first), with ``remote_url`` set.

        Raises: InvalidArgument, NotFound, FailedPrecondition (no remote, bundle not committed or
        not localized), DataLoss (a local blob is missing or truncated), Unavailable.
        """
        with ctx.push_lock:
            with ctx.lock:
                if ref is not None:
                    bundle = ctx.resolve(ref)
                    if not bundle.committed:
                        raise FailedPrecondition(
                            f"bundle {label(bundle)} is not committed: commit it before pushing"
                        )
                    targets = [bundle]
                else:
                    targets = sorted(
                        (b for b in ctx.bundles.values() if b.committed and b.remote_url != remote.url), key=age
                    )
                    skipped = [] if ctx.shared else [b for b in targets if not b.localized]
                    if skipped:
                        log.warning("push of %s skips %d bundles pulled without their files (first: %s); "
                                    "pull them with localize=True to push them to %s",
                                    ctx.id, len(skipped), label(skipped[0]), remote.url)
                        targets = [b for b in targets if b.localized]
            for bundle in targets:
                if not bundle.localized and not ctx.shared:
                    raise FailedPrecondition(
                        f"bundle {label(bundle)} is not localized, so its files cannot be pushed to "
                        f"{remote.url}: pull it with localize=True first"
                    )
            reporter = ProgressReporter(progress)
            blobs = _unique_blobs([b for b in targets if b.localized])
            uploader = Uploader(remote, ctx.dir, self._pool, self._settings, reporter)
            stats = uploader.upload(blobs)
            self._put_manifests(remote, targets)
            if unstage:
                remote.delete([remote.staged_key(b.name, b.uuid) for b in targets])
            pushed, intents = [], []
            with ctx.lock:
                for bundle in targets:
                    current = ctx.bundles.get(bundle.uuid)
                    if current is None:  # deleted meanwhile
                        continue
                    if current.remote_url != remote.url:
                        current = current.with_state(remote_url=remote.url)
                        intents.append(self._events.pushing(current))
                        ctx.record(current)
                    else:
                        intents.append(self._events.pushing(current))
                    pushed.append(current)
            reporter.emit(force=True)
        log.info("pushed %d bundles of %s to %s: %s", len(pushed), ctx.id, remote.url, stats)
        for intent in intents:
            self._events.announce(intent)
        return pushed

    def _put_manifests(self, remote: S3Remote, bundles: list[Bundle]) -> None:
        runner = TaskRunner(self._pool, max_in_flight=self._settings.max_in_flight, max_heavy=1)
        for bundle in bundles:
            data = bundle.to_json(local_state=False)
            runner.add(lambda bundle=bundle, data=data: remote.put_manifest(
                remote.manifest_key(bundle.name, bundle.uuid), data,
                signature=self._keys.sign(bundle.name, bundle.uuid, data),
            ))
        runner.run()

    def upload_blobs(self, ctx: ContextState, remote: S3Remote, bundle: Bundle) -> None:
        """The blobs of a bundle this store holds with its files, to ``remote`` (the missing ones).
        Raises: DataLoss (a local blob is missing or truncated), Unavailable."""
        if bundle.localized:
            Uploader(remote, ctx.dir, self._pool, self._settings, ProgressReporter(None)).upload(_unique_blobs([bundle]))

    def stage(self, ctx: ContextState, remote: S3Remote, bundle: Bundle) -> Bundle:
        """Make an uncommitted bundle of a shared context visible to every store sharing ``remote``
        (its blobs there already, :meth:`upload_blobs`): its signed manifest under ``staging/``, written
        only if no store staged that uuid first (an idempotency key's adds on two stores share a uuid),
        nor committed it (then unstaged) before this one staged.
        Returns the staged bundle: this one, or the first store's (verified; committed, if it was
        committed meanwhile).

        Raises: DataLoss (the first store's manifest does not verify), NotFound (it was removed
        meanwhile), Unavailable.
        """
        data = bundle.with_state(committed=False, commit_time=None).to_json(local_state=False)
        key = remote.staged_key(bundle.name, bundle.uuid)
        if remote.put_manifest(key, data, signature=self._keys.sign(bundle.name, bundle.uuid, data, staged=True),
                               if_absent=True):
            committed_key = remote.manifest_key(bundle.name, bundle.uuid)
            if not bundle.idempotency_key or remote.stat(committed_key) is None:
                return bundle.with_state(committed=False, commit_time=None)
            remote.delete([key])  # the key's first add was committed (and unstaged) before this one staged
        for item in (RemoteManifest(bundle.name, bundle.uuid, key, staged=True),
                     RemoteManifest(bundle.name, bundle.uuid, remote.manifest_key(bundle.name, bundle.uuid))):
            try:
                return _parse_remote_manifest(remote, item, ctx.id, self._keys)
            except NotFound:
                continue  # committed (and unstaged) since the write was refused: its committed manifest
            except _Rejected as rejected:
                raise DataLoss(f"bundle {label(bundle)} was staged first by another store, but its manifest is "
                               f"refused: {rejected.message}") from None
        raise NotFound(f"bundle {label(bundle)} was staged by another store and removed since")

    def pull(self, ctx: ContextState, remote: S3Remote, bundle_name: str | None = None, *,
             localize: bool = False, progress: ProgressCallback | None = None,
             only_uuid: str | None = None) -> list[Bundle]:
        """Pull bundle manifests from the context's remote (all, or the versions of one name);
        with ``localize``, also download and verify their files (and those of bundles pulled
        earlier without files). Nothing is recorded unless every blob verified. ``only_uuid``: that
        version alone (a shared context's read of one bundle).

        Every remote manifest is verified on its own (its key names a canonical UUID and a valid
        name, one of the store's keys signed it under that name and uuid, it parses, its uuid and
        name are the key's, its paths and hashes follow the rules of an add, its content_hash
        matches): one that fails is logged, reported to the store's ``on_rejected`` and skipped,
        and the others are pulled.

        A shared context pulls its staged (uncommitted) bundles too: a version held here uncommitted
        whose committed manifest is on the remote now is recorded committed, and one that came from
        the remote uncommitted and is on it no more (deleted, or staged by an add that lost its
        idempotency key's race) is dropped.

        Returns the bundles this pull added or localized, newest first.

        Raises: InvalidArgument, NotFound, FailedPrecondition (no remote), DataLoss (a remote
        blob does not match its hash, or is missing), Unavailable.
        """
        with ctx.pull_lock:
            listed = remote.list_manifests(bundle_name or None, staged=ctx.shared)
            if only_uuid is not None:
                listed = [m for m in listed if m.uuid == only_uuid]
            committed_uuids = {m.uuid for m in listed if not m.staged}
            listed = [m for m in listed if not (m.staged and m.uuid in committed_uuids)]  # mid-commit: committed
            with ctx.lock:
                known = dict(ctx.bundles)
            fresh = self._fetch_verified(ctx, remote, [
                m for m in listed if m.uuid not in known or (not m.staged and not known[m.uuid].committed)])
            to_localize: list[Bundle] = []
            if localize:
                to_localize = list(fresh) + [
                    known[m.uuid] for m in listed if m.uuid in known and not known[m.uuid].localized
                ]
            reporter = ProgressReporter(progress)
            needed = self._blobs_to_fetch(ctx, to_localize)
            stats = Downloader(remote, ctx.dir, self._pool, self._settings, reporter).download(needed)
            changed: list[Bundle] = []
            with ctx.lock:  # gc removes blobs under this lock: what is present now stays until recorded

                def present(bundle: Bundle) -> bool:
                    """Its blobs are all here (a gc between the download and now may have removed some)."""
                    return all(ctx.dir.blob_path(f.sha256).exists() for f in bundle.files)

                for bundle in fresh:
                    held = ctx.bundles.get(bundle.uuid)
                    if held is not None and held.committed:
                        continue  # committed here meanwhile: its own write-through publishes it
                    localized = (held.localized and held.content_hash == bundle.content_hash) if held is not None \
                        else present(bundle)
                    record = bundle.with_state(context=ctx.id, remote_url=remote.url, localized=localized)
                    ctx.record(record)
                    changed.append(record)
                if ctx.shared:
                    self._drop_unlisted(ctx, remote, {m.uuid for m in listed}, bundle_name, only_uuid)
                if localize:
                    for old in to_localize[len(fresh):]:
                        current = ctx.bundles.get(old.uuid)
                        if current is not None and not current.localized and present(current):
                            record = current.with_state(localized=True, remote_url=current.remote_url or remote.url)
                            ctx.record(record)
                            changed.append(record)
                missed = [bundle.name for bundle in changed if localize and not bundle.localized]
                if missed:
                    log.warning("pull into %s: blobs of %s were removed (a gc ran meanwhile) before the pull "
                                "recorded them; they stay not localized, pull again", ctx.id, ", ".join(missed))
            reporter.emit(force=True)
        log.info("pulled %d bundles into %s from %s: %s", len(changed), ctx.id, remote.url, stats)
        return sorted(changed, key=age, reverse=True)

    @staticmethod
    def _drop_unlisted(ctx: ContextState, remote: S3Remote, listed: set[str], bundle_name: str | None,
                       only_uuid: str | None) -> None:
        """Forget the uncommitted versions this store has from the remote (lock held) that the listing
        covered and did not find: the remote is a shared context's truth for them."""
        for bundle in list(ctx.bundles.values()):
            if (not bundle.committed and bundle.remote_url == remote.url and bundle.uuid not in listed
                    and bundle_name in (None, bundle.name) and only_uuid in (None, bundle.uuid)):
                ctx.forget(bundle.uuid)
                log.info("context %s: the uncommitted bundle %s is no longer staged on %s; forgotten",
                         ctx.id, label(bundle), remote.url)

    def fetch_manifests(self, ctx: ContextState, remote: S3Remote, listed: list[Any]) -> list[Bundle]:
        """Every listed manifest, verified but for its signature; the first that fails raises
        DataLoss (remote gc: nothing may be removed on the word of a partial listing, and a manifest,
        signed or not, only keeps the blobs it names)."""
        fetched: list[Bundle] = []
        runner = TaskRunner(self._pool, max_in_flight=self._settings.max_in_flight, max_heavy=1)
        for item in listed:
            runner.add(lambda item=item: _parse_remote_manifest(remote, item, ctx.id, None), on_done=fetched.append)
        runner.run()
        return fetched

    def _fetch_verified(self, ctx: ContextState, remote: S3Remote, listed: list[Any]) -> list[Bundle]:
        """The listed manifests that verify; each one that does not is reported and skipped.
        S3 failures (Unavailable, refused credentials) still fail the pull."""
        results: list[Bundle | _Rejected] = []

        def one(item: Any) -> Bundle | _Rejected:
            try:
                return _parse_remote_manifest(remote, item, ctx.id, self._keys)
            except _Rejected as rejected:
                return rejected

        runner = TaskRunner(self._pool, max_in_flight=self._settings.max_in_flight, max_heavy=1)
        for item in listed:
            runner.add(lambda item=item: (item, one(item)), on_done=results.append)
        runner.run()
        fetched = []
        for item, result in results:
            if isinstance(result, Bundle):
                fetched.append(result)
                continue
            log.warning("pull into %s skips the remote manifest %r on %s (%s): %s",
                        ctx.id, item.key, remote.url, result.reason, result.message)
            if self._on_rejected is not None:
                self._on_rejected(RejectedManifest(remote.url, item.key, result.reason, result.message))
        return fetched

    def _blobs_to_fetch(self, ctx: ContextState, bundles: list[Bundle]) -> list[BlobRef]:
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
                    needed[entry.sha256] = BlobRef(entry.sha256, entry.size, label(bundle), entry.path)
        return list(needed.values())


def _unique_blobs(bundles: list[Bundle]) -> list[BlobRef]:
    blobs: dict[str, BlobRef] = {}
    for bundle in bundles:
        for entry in bundle.files:
            blobs.setdefault(entry.sha256, BlobRef(entry.sha256, entry.size, label(bundle), entry.path))
    return list(blobs.values())


def _parse_remote_manifest(remote: S3Remote, item: Any, context_id: str, keys: ManifestKeys | None) -> Bundle:
    """Fetch and verify one remote manifest: its key names a canonical UUID and a valid bundle
    name, one of ``keys`` signed it under that name and uuid (checked before anything in it is
    read; None: not checked), the manifest is well-formed and describes that bundle, its paths
    follow the rules of an add, its hashes are lowercase sha256, its sizes and int values fit the
    API's int64 (a bundle recorded with more would fail every later read of its context) and its
    content hash is right.

    Raises: _Rejected (a DataLoss saying why), Unavailable and the rest of what S3 may raise.
    """
    where = f"the manifest {item.key!r} on {remote.url}"
    if not is_uuid(item.uuid):
        raise _Rejected("key", f"{where} is not named by a canonical UUID (got {item.uuid!r})")
    try:
        validate_bundle_name(item.bundle_name)
    except InvalidArgument as exc:
        raise _Rejected("key", f"{where} is not under a valid bundle name: {exc.message}") from None
    try:
        stored = remote.get_manifest(item.key, max_bytes=MAX_MANIFEST_BYTES)
    except DataLoss as exc:
        raise _Rejected("unreadable", f"{where} is corrupt: {exc.message}") from None
    if keys is not None and stored.signature is None:
        raise _Rejected("signature", f"{where} is refused: signature missing (it was not pushed by a bundle-store "
                                     "holding the manifest keys, or was pushed before manifests were signed: "
                                     "push it again from a store that holds it)")
    if keys is not None and not keys.verify(item.bundle_name, item.uuid, stored.data, stored.signature or "",
                                            staged=item.staged):
        raise _Rejected("signature", f"{where} is refused: signature invalid (signed with another key, "
                                     "changed after it was signed, or copied from another name or uuid)")
    try:
        bundle = Bundle.from_json(stored.data, context=context_id)
    except (ValueError, RecursionError) as exc:
        raise _Rejected("unreadable", f"{where} is corrupt: {exc}") from None
    problems = []
    if not is_uuid(bundle.uuid):
        problems.append(f"its uuid {bundle.uuid!r} is not a canonical UUID")
    try:
        validate_bundle_name(bundle.name)
    except InvalidArgument as exc:
        problems.append(exc.message)
    problems.extend(rule for _, rule in path_violations([entry.path for entry in bundle.files]))
    problems.extend(f"files[{index}].sha256 {entry.sha256!r} is not 64 lowercase hex digits"
                    for index, entry in enumerate(bundle.files)
                    if not _SHA256.fullmatch(entry.sha256))
    problems.extend(f"lineage.input_uuids has {uuid!r}, not a canonical UUID"
                    for uuid in bundle.lineage.input_uuids if not is_uuid(uuid))
    problems.extend(f"files[{index}].size {entry.size} is not in [0, {INT64_MAX}]"
                    for index, entry in enumerate(bundle.files) if not 0 <= entry.size <= INT64_MAX)
    if bundle.size > INT64_MAX:
        problems.append(f"its files total {bundle.size} bytes, more than {INT64_MAX}")
    problems.extend(f"values[{key}] {value} does not fit in a signed 64-bit integer"
                    for key, value in bundle.values.items()
                    if type(value) is int and not INT64_MIN <= value <= INT64_MAX)
    if problems:
        raise _Rejected("invalid", f"{where} is corrupt: {'; '.join(problems[:5])}"
                                   + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
    if bundle.uuid != item.uuid or bundle.name != item.bundle_name:
        raise _Rejected("mismatch", f"{where} describes bundle {bundle.name!r} ({bundle.uuid}), "
                                    "not the one its key names")
    actual = compute_content_hash(bundle.files, bundle.values)
    if actual != bundle.content_hash:
        raise _Rejected("content_hash", f"{where} is corrupt: its content_hash is {bundle.content_hash}, but its "
                                        f"files and values hash to {actual}")
    if item.staged:
        return bundle.with_state(committed=False, commit_time=None)
    return bundle.with_state(committed=True, commit_time=bundle.commit_time or bundle.create_time)
