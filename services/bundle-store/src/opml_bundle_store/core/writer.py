"""Adding a bundle: its files are staged and hashed, then made visible at once by ``finish()``."""

from __future__ import annotations

import hashlib
import mimetypes
import os
import shutil
import threading
import uuid as uuid_mod
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from opml_bundle_store.core.context import ContextState
from opml_bundle_store.core.events import BundleEvents
from opml_bundle_store.core.layout import fsync_dir, make_durable
from opml_bundle_store.core.manifest import (
    DEFAULT_MEDIA_TYPE,
    Bundle,
    FileEntry,
    Lineage,
    compute_content_hash,
    compute_request_digest,
)
from opml_bundle_store.core.rules import check_int, validate_media_type, validate_sha256
from opml_bundle_store_contract.paths import COLLISION_RULE, PathSet, validate_bundle_path
from opml_bundle_store_contract.values import Value
from opml_common.errors import AlreadyExists, FailedPrecondition, InvalidArgument

READ_CHUNK = 1024 * 1024


def check_same_request(earlier: Bundle, digest: str) -> None:
    """Refuse an add of ``earlier``'s idempotency key that asks for other content than the add that made
    ``earlier`` (``digest``: its :func:`compute_request_digest`): a key stands for one request.

    Raises: AlreadyExists naming the key, the name and the key's bundle.
    """
    if earlier.request_digest != digest:
        raise AlreadyExists(
            f"idempotency key {earlier.idempotency_key!r} of bundle {earlier.name!r} in context {earlier.context!r} "
            f"is taken by an earlier add whose content differs (its files, values, tags or lineage): that add "
            f"made {earlier.uuid}. Send that add's request again to get it, or use a new key for this one")


class BundleWriter:
    """Stages the files of a new bundle; ``finish()`` makes it visible atomically.

    Returned by :meth:`BundleStore.new_bundle`. As a context manager it aborts (removes every
    staged byte) when the block raises or ends without ``finish()``. One writer is meant for one
    thread at a time; different writers may run concurrently.

    ``idempotency_key`` (non-empty): ``finish()`` of an add whose name and key a bundle of the context
    has already returns that bundle and stages nothing more (committing it, if asked and it is not) when
    the add asks for what the first one did (:func:`compute_request_digest`), and refuses it
    (AlreadyExists) when not.
    ``publish``: called once the bundle is visible and announced with it, whether this writer made it,
    whether the add asked for a commit and the add's request digest (a context shared through its
    remote stages or commits it there); what it returns is what ``finish()`` returns. A keyed add
    leaves both its commit and the comparison of its request to ``publish``, which claims the key on
    the remote first: the first add staged there is the key's, wherever it was made.
    ``uuid``: the new version's (default: a random one).
    """

    def __init__(
        self, ctx: ContextState, name: str, *,
        tags: dict[str, str], values: dict[str, Value], lineage: Lineage, events: BundleEvents,
        idempotency_key: str = "", publish: Callable[[Bundle, bool, bool, str], Bundle] | None = None,
        uuid: str | None = None,
    ) -> None:
        self._ctx = ctx
        self._idempotency_key = idempotency_key
        self._publish = publish
        self._events = events
        self.name = name
        self.uuid = uuid or str(uuid_mod.uuid4())
        self._tags = tags
        self._values = values
        self._lineage = lineage
        self._staging = ctx.dir.new_staging_dir()
        self._files: list[FileEntry] = []
        self._staged: list[Path] = []
        self._paths = PathSet()
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
            collision = self._paths.collision(path)
            if collision is not None:
                problem, other = collision
                raise InvalidArgument("path", f"`path` {path!r} {problem} the path {other!r} already added: "
                                              f"{COLLISION_RULE}.")
            media = DEFAULT_MEDIA_TYPE if media_type is None else validate_media_type(media_type)
            want_sha = None if expected_sha256 is None else validate_sha256(expected_sha256, "expected_sha256")
            if expected_size is not None:
                check_int("expected_size", expected_size, 0, 2**63 - 1)
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

        A committed bundle is announced (BundleCommitted) once it is visible.

        Raises: FailedPrecondition (already finished or aborted), OSError (disk). On failure the
        writer is aborted and nothing is visible (an OSError recording the event comes after the
        bundle is visible). What ``after_commit`` raises (Unavailable: the remote of a shared context
        cannot be reached), the bundle visible and committed here: a retry with the same
        idempotency key writes it through again. So does what ``publish`` raises for an uncommitted
        bundle (its staging), the bundle visible here.
        """
        with self._lock:
            self._check_open()
            self._state = "finishing"
        ctx = self._ctx
        digest = compute_request_digest(self.name, self._tags, self._files, self._values, self._lineage)
        keyed_publish = bool(self._idempotency_key) and self._publish is not None
        try:
            make_durable(self._staged)
            with ctx.lock:
                earlier = self._earlier_add()
                made = earlier is None
                if earlier is not None:
                    if not keyed_publish:
                        check_same_request(earlier, digest)
                    bundle, intent = self._repeated(earlier, commit=commit and not keyed_publish)
                else:
                    bundle, intent = self._record(commit and not keyed_publish)
        except BaseException:
            self._state = "open"
            self.abort()
            raise
        shutil.rmtree(self._staging, ignore_errors=True)
        self._state = "finished"
        self._events.announce(intent)
        if self._publish is not None:
            return self._publish(bundle, made, commit, digest)
        return bundle

    def _record(self, commit: bool) -> tuple[Bundle, Any]:
        """Staged blobs into the store, then the manifest: the bundle and its commit's intent (lock held)."""
        ctx = self._ctx
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
            remote_url=None, localized=True, idempotency_key=self._idempotency_key,
        )
        intent = self._events.committing(bundle) if commit else None
        ctx.record(bundle)
        return bundle, intent

    def _earlier_add(self) -> Bundle | None:
        """The bundle an earlier add of this name and idempotency key made (lock held)."""
        if not self._idempotency_key:
            return None
        return next((b for b in self._ctx.bundles.values()
                     if b.name == self.name and b.idempotency_key == self._idempotency_key), None)

    def _repeated(self, earlier: Bundle, *, commit: bool) -> tuple[Bundle, Any]:
        """A repeated add keeps nothing of its own: the earlier bundle, committed if asked, and the
        commit's intent to announce (lock held)."""
        if not commit or earlier.committed:
            return earlier, None
        earlier = earlier.with_state(committed=True, commit_time=self._ctx.next_time(), remote_url=None)
        intent = self._events.committing(earlier)
        self._ctx.record(earlier)
        return earlier, intent

    def abort(self) -> None:
        """Drop every staged file. Idempotent; a no-op after ``finish()``."""
        with self._lock:
            if self._state in ("finished", "aborted"):
                return
            self._state = "aborted"
        shutil.rmtree(self._staging, ignore_errors=True)
