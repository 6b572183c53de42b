"""Garbage collection: blobs that no manifest references, old enough that no add, pull or push in
flight can still need them, locally or on a context's remote."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from opml_bundle_store.core.context import ContextState, now
from opml_bundle_store.core.manifest import Bundle, GcReport
from opml_bundle_store.core.remote import RemoteManifest, S3Remote

log = logging.getLogger(__name__)

FetchManifests = Callable[[ContextState, S3Remote, list[Any]], list[Bundle]]


def collect_local(ctx: ContextState, *, grace_s: float, dry_run: bool) -> GcReport:
    """Remove the context's local blobs that no manifest references and older than ``grace_s``
    (their upload states too), holding the context's lock."""
    removed = freed = kept = 0
    with ctx.lock:
        referenced = {entry.sha256 for bundle in ctx.bundles.values() for entry in bundle.files}
        cutoff = now().timestamp() - grace_s
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


def collect_remote(ctx: ContextState, remote: S3Remote, fetch_manifests: FetchManifests, *, grace_s: float,
                   staging_ttl_s: float, dry_run: bool) -> GcReport:
    """Remove the remote's blobs that no remote manifest references and older than ``grace_s``, and
    abort multipart uploads older than that, holding the context's push lock. Staged manifests (a
    shared context's uncommitted bundles) keep their blobs, but go first when they are abandoned:
    their bundle is committed (a commit stopped before it removed them), or they are older than
    ``staging_ttl_s`` (an upload nobody committed).

    Raises: DataLoss (a remote manifest is unreadable: nothing is removed), Unavailable.
    """
    with ctx.push_lock:  # this store's pushes cannot race with the listing below
        listed = remote.list_manifests(staged=True)
        abandoned = _abandoned_staging(listed, now() - timedelta(seconds=staging_ttl_s))
        manifests = fetch_manifests(ctx, remote, [m for m in listed if m.key not in abandoned])
        referenced = {entry.sha256 for bundle in manifests for entry in bundle.files}
        cutoff = now() - timedelta(seconds=grace_s)
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
            remote.delete(sorted(abandoned))  # first: a blob is removed only once nothing names it
            remote.delete(doomed)
            for upload in remote.list_uploads(remote.objects_prefix):
                if upload.initiated is not None and upload.initiated < cutoff:
                    remote.abort_multipart(upload.key, upload.upload_id)
    log.info("gc %s (remote %s%s): removed %d abandoned staged manifests, %d blobs, %d bytes; kept %d",
             ctx.id, remote.url, ", dry run" if dry_run else "", len(abandoned), removed, freed, kept)
    return GcReport(removed, freed, kept)


def _abandoned_staging(listed: list[RemoteManifest], expired: datetime) -> set[str]:
    """The keys of staged manifests whose bundle is committed, or staged before ``expired``."""
    committed = {m.uuid for m in listed if not m.staged}
    return {m.key for m in listed if m.staged and (
        m.uuid in committed or (m.last_modified is not None and m.last_modified < expired))}
