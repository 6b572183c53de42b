"""One context in memory: its bundle index, locks and clock, loaded from its directory at open.

``lock`` guards ``bundles`` and the context's files; ``push_lock`` and ``pull_lock`` keep one push
and one pull of the context at a time. Methods that say "lock held" expect the caller to hold ``lock``.
"""

from __future__ import annotations

import json
import logging
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

from opml_bundle_store.core.layout import ContextDir, atomic_write, fsync_dir
from opml_bundle_store.core.manifest import Bundle, ContextInfo, age, latest_version
from opml_bundle_store.core.remote_url import normalize_remote_url
from opml_bundle_store.core.rules import is_uuid, validate_bundle_name, validate_context_id
from opml_common.errors import InvalidArgument, NotFound

log = logging.getLogger(__name__)


def now() -> datetime:
    return datetime.now(UTC)


class ContextState:
    """In-memory state of one context."""

    def __init__(self, context_id: str, directory: ContextDir, remote_url: str | None) -> None:
        self.id = context_id
        self.dir = directory
        self.remote_url = remote_url
        self.lock = threading.RLock()
        self.push_lock = threading.Lock()
        self.pull_lock = threading.Lock()
        self.bundles: dict[str, Bundle] = {}
        self.last_time: datetime | None = None
        self.revoked_grants: set[str] = set()
        """Upload grants of the context seen revoked (for good, so remembered; one not seen is looked up)."""
        self.shared = False
        """Served by several stores through its remote (:meth:`BundleStore.share_context`): the remote
        is the truth for its committed bundles, commits are written through, reads merge the remote."""

    def info(self) -> ContextInfo:
        with self.lock:
            return ContextInfo(self.id, self.remote_url, len(self.bundles))

    def next_time(self) -> datetime:
        """Now, but strictly after every time this context handed out (so newest-first is total)."""
        moment = now()
        if self.last_time is not None and moment <= self.last_time:
            moment = self.last_time + timedelta(microseconds=1)
        self.last_time = moment
        return moment

    def resolve(self, ref: str, *, prefer_committed: bool = True) -> Bundle:
        """The bundle ``ref`` names: a uuid, or a name (its latest committed version, else its latest;
        the latest of all with ``prefer_committed=False``). Lock held.

        A canonical UUID (``str(uuid.UUID(ref)) == ref``) is looked up by uuid, then by name; any
        other ref only by name. The index only holds canonical uuids (:func:`load_context` and
        pulls skip manifests with any other), so a forged ``uuid: "model"`` never stands for the
        bundle named ``model``.

        Raises: InvalidArgument (``ref``), NotFound.
        """
        if not isinstance(ref, str) or not ref:
            raise InvalidArgument("ref", f"`ref` must be a bundle uuid or bundle name, but got {ref!r}.")
        if is_uuid(ref):  # only a canonical UUID is looked up as one, so no uuid shadows a name
            found = self.bundles.get(ref)
            if found is not None:
                return found
        else:
            validate_bundle_name(ref, "ref")
        versions = [bundle for bundle in self.bundles.values() if bundle.name == ref]
        if not versions:
            kind = "uuid or name" if is_uuid(ref) else "name"
            raise NotFound(f"bundle {ref!r} does not exist in context {self.id!r} (no bundle has that {kind})")
        return latest_version(versions) if prefer_committed else max(versions, key=age)

    def record(self, bundle: Bundle) -> None:
        """Persist a bundle's manifest with its local state and update the index. Lock held."""
        atomic_write(self.dir.manifest_path(bundle.uuid), bundle.to_json())
        self.bundles[bundle.uuid] = bundle

    def forget(self, uuid: str) -> None:
        """Remove a bundle's manifest and drop it from the index (its blobs stay until gc). Lock held."""
        if self.bundles.pop(uuid, None) is not None:
            self.dir.manifest_path(uuid).unlink(missing_ok=True)
            fsync_dir(self.dir.bundles)


def load_context(root: Path) -> ContextState | None:
    """The context in ``root``, after removing the leftovers of adds and pulls that never finished;
    None (logged) when ``root`` holds no readable context. Unreadable manifests are skipped (logged)."""
    directory = ContextDir(root)
    try:
        settings = json.loads(directory.context_file.read_bytes())
        context_id = validate_context_id(settings["id"])
        remote_url = normalize_remote_url(settings.get("remote_url"))
    except (OSError, ValueError, KeyError, TypeError, InvalidArgument) as exc:
        log.error("skipping %s: not a readable context (%s)", root, exc)
        return None
    directory.create_dirs()
    removed = directory.recover()
    if removed:
        log.warning("context %s: removed %d leftovers of unfinished adds and pulls", context_id, removed)
    ctx = ContextState(context_id, directory, remote_url)
    for manifest in directory.bundles.glob("*.json"):
        try:
            bundle = Bundle.from_json(manifest.read_bytes(), context=context_id)
        except (OSError, ValueError) as exc:
            log.error("context %s: skipping the unreadable manifest %s (%s)", context_id, manifest, exc)
            continue
        if not is_uuid(bundle.uuid) or manifest.name != f"{bundle.uuid}.json":
            log.error("context %s: skipping the manifest %s: its uuid %r is not the canonical UUID its file "
                      "name holds", context_id, manifest, bundle.uuid)
            continue
        ctx.bundles[bundle.uuid] = bundle
        for time in (bundle.create_time, bundle.commit_time):
            if time is not None and (ctx.last_time is None or time > ctx.last_time):
                ctx.last_time = time
    return ctx
