"""The on-disk layout of one local context, and the durable-write helpers it relies on.

``home/contexts/<id>/`` holds::

    context.json            the context's settings (its remote URL)
    objects/ab/ab12...      content-addressed blobs, named by their sha256, shared by all bundles
    bundles/<uuid>.json     one manifest per bundle version (the bundle exists iff this file does)
    staging/<writer>/       files of adds in progress; moved into objects/ when the add finishes
    tmp/                    downloads in progress; moved into objects/ once verified
    uploads/<sha256>.json   multipart uploads in progress (upload id), kept so a re-push resumes
    revoked-grants/<id>     upload grants of the context revoked (their revocation time, JSON)

Every file that others read is written to a temporary name in the same directory, fsynced and
renamed, so a crash leaves either the old or the new file, never half of one. Temporary names
start with '.' and end with '.tmp'; :meth:`ContextDir.recover` removes them with the staging and
download leftovers of adds and pulls that never finished.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

TMP_SUFFIX = ".tmp"
_SHA256 = re.compile(r"[0-9a-f]{64}")


def fsync_dir(path: Path) -> None:
    """Make the directory entries of ``path`` (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _LIBC = False
    return _LIBC


_LIBC: Any = None


def sync_filesystem(path: Path) -> None:
    """Flush every dirty page of the filesystem holding ``path`` (Linux ``syncfs``; else ``sync``)."""
    libc = _libc()
    syncfs = getattr(libc, "syncfs", None) if libc else None
    if syncfs is None:
        os.sync()
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        if syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs failed: {os.strerror(err)}", str(path))
    finally:
        os.close(fd)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a range of a file to disk now (Linux ``sync_file_range``),
    so a later fsync has little left to do. A no-op where unsupported."""
    libc = _libc()
    call = getattr(libc, "sync_file_range", None) if libc else None
    if call is not None:
        call(ctypes.c_int(fd), ctypes.c_int64(offset), ctypes.c_int64(length), ctypes.c_uint(_SYNC_FILE_RANGE_WRITE))


_SYNC_FILE_RANGE_WRITE = 2
#: Above this many files, one syncfs is cheaper than an fsync each.
FSYNC_EACH_MAX = 8


def make_durable(files: Sequence[Path]) -> None:
    """Make the contents of ``files`` (all on one filesystem) durable: an fsync each when they
    are few, one syncfs when they are many (10,000 fsyncs cost seconds, one syncfs milliseconds)."""
    if not files:
        return
    if len(files) <= FSYNC_EACH_MAX:
        for path in files:
            fsync_file(path)
    else:
        sync_filesystem(files[0].parent)


def tmp_name(path: Path) -> Path:
    """A unique temporary sibling of ``path`` that :meth:`ContextDir.recover` knows to remove."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}")


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably (tmp + fsync + rename + fsync dir)."""
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


class ContextDir:
    """Paths of one local context and the operations on its directory tree."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.context_file = root / "context.json"
        self.objects = root / "objects"
        self.bundles = root / "bundles"
        self.staging = root / "staging"
        self.tmp = root / "tmp"
        self.uploads = root / "uploads"
        self.revoked_grants = root / "revoked-grants"

    def create_dirs(self) -> None:
        for path in (self.objects, self.bundles, self.staging, self.tmp, self.uploads):
            path.mkdir(parents=True, exist_ok=True)

    def blob_path(self, sha256: str) -> Path:
        """``objects/ab/ab12...``; ``sha256`` must be 64 lowercase hex digits, so the path stays in ``objects/``."""
        if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
            raise ValueError(f"a blob is named by a lowercase hex sha256, not {sha256!r}")
        return self.objects / sha256[:2] / sha256

    def manifest_path(self, bundle_uuid: str) -> Path:
        """``bundles/<uuid>.json``; ``bundle_uuid`` must be a canonical UUID, so the path stays in ``bundles/``."""
        try:
            canonical = str(uuid.UUID(bundle_uuid)) == bundle_uuid
        except (ValueError, TypeError, AttributeError):
            canonical = False
        if not canonical:
            raise ValueError(f"a manifest is named by a canonical UUID, not {bundle_uuid!r}")
        return self.bundles / f"{bundle_uuid}.json"

    def revoked_grant_path(self, grant_id: str) -> Path:
        """``revoked-grants/<id>``; ``grant_id`` is checked first (16 hex digits), so it stays there."""
        return self.revoked_grants / grant_id

    def upload_state_path(self, sha256: str) -> Path:
        return self.uploads / f"{sha256}.json"

    def new_staging_dir(self) -> Path:
        path = self.staging / uuid.uuid4().hex
        path.mkdir(parents=True)
        return path

    def new_tmp_file(self) -> Path:
        return self.tmp / f".{uuid.uuid4().hex}{TMP_SUFFIX}"

    def recover(self) -> int:
        """Remove what unfinished adds and pulls left behind; return how many entries went.

        Called only while no writer of this context is active (when the store opens).
        Multipart upload states are kept: they let the next push resume.
        """
        removed = 0
        for area in (self.staging, self.tmp):
            if area.exists():
                for entry in area.iterdir():
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)
                    removed += 1
        for directory in (self.bundles, self.uploads, *self._blob_dirs()):
            for entry in directory.glob(f".*{TMP_SUFFIX}"):
                entry.unlink(missing_ok=True)
                removed += 1
        return removed

    def _blob_dirs(self) -> list[Path]:
        return [path for path in self.objects.iterdir() if path.is_dir()] if self.objects.exists() else []

    def iter_blobs(self) -> Iterator[tuple[str, Path, os.stat_result]]:
        """Every blob as ``(sha256, path, stat)``; temporary files are skipped."""
        for directory in self._blob_dirs():
            with os.scandir(directory) as entries:
                for entry in entries:
                    if entry.name.startswith(".") or not entry.is_file(follow_symlinks=False):
                        continue
                    try:
                        yield entry.name, Path(entry.path), entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
