"""Parallel blob transfers between a local context and its S3 remote.

One coordinating thread (the caller's) feeds small tasks to the store's shared thread pool and
reacts to their results; workers never wait on each other, so one pool serves any number of
concurrent pushes and pulls without deadlock. Progress callbacks run on the coordinating thread.

Uploads (push):
  * blobs already on the remote are skipped (one listing for many blobs, a HEAD each for few);
  * a blob below ``multipart_threshold`` is one PUT signed with the sha256 the manifest holds
    (no re-hashing);
  * a larger blob is a multipart upload whose parts go up in parallel. Its upload id is written
    to ``uploads/<sha256>.json`` before the first part, so after an interrupted push the next one
    lists the parts already on the remote and sends only the missing ones.

Downloads (pull):
  * a blob up to ``range_size`` is one streaming GET, hashed as it is written;
  * a larger blob is fetched as parallel range GETs into a sparse file, hashed in order while
    later ranges are still downloading (see :class:`_RangedBlob`);
  * a blob becomes visible in ``objects/`` only after its size and sha256 match, else
    :class:`DataLoss` names the bundle, the file and both hashes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opml_bundle_store.core.layout import ContextDir, atomic_write, fsync_dir, make_durable, start_writeback
from opml_bundle_store.core.manifest import TransferProgress
from opml_bundle_store.core.remote import BLOB_CONTENT_TYPE, S3Remote
from opml_common.errors import DataLoss, NotFound, OpmlError

log = logging.getLogger(__name__)

MIB = 1024 * 1024
MAX_PARTS = 10_000
HASH_CHUNK = 4 * MIB
#: Above this many blobs, one listing of the remote's objects/ replaces a HEAD per blob.
LIST_THRESHOLD = 256
#: Tasks moving more bytes than this count against the per-call stream limit (memory, bandwidth).
HEAVY_BYTES = 4 * MIB


# ----------------------------------------------------------------------------------------------
# Scheduling


@dataclass
class _Task:
    fn: Callable[[], Any]
    heavy: bool
    on_done: Callable[[Any], None] | None


class TaskRunner:
    """Runs tasks on a shared pool, coordinated from the calling thread.

    At most ``max_in_flight`` tasks of this runner are in the pool at once, and at most
    ``max_heavy`` of them heavy (large parts or ranges). ``on_done`` callbacks run on the calling
    thread and may add more tasks. The first failure stops new submissions; tasks in flight are
    awaited, then the failure is raised.
    """

    def __init__(self, pool: Executor, *, max_in_flight: int, max_heavy: int) -> None:
        self._pool = pool
        self._max_in_flight = max(1, max_in_flight)
        self._max_heavy = max(1, max_heavy)
        self._light: deque[_Task] = deque()
        self._heavy: deque[_Task] = deque()

    def add(self, fn: Callable[[], Any], *, heavy: bool = False, on_done: Callable[[Any], None] | None = None) -> None:
        (self._heavy if heavy else self._light).append(_Task(fn, heavy, on_done))

    def run(self) -> None:
        in_flight: dict[Future, _Task] = {}
        heavy_in_flight = 0
        error: BaseException | None = None
        while True:
            while error is None and len(in_flight) < self._max_in_flight:
                if self._heavy and heavy_in_flight < self._max_heavy:
                    task = self._heavy.popleft()
                    heavy_in_flight += 1
                elif self._light:
                    task = self._light.popleft()
                else:
                    break
                in_flight[self._pool.submit(task.fn)] = task
            if not in_flight:
                break
            done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for future in done:
                task = in_flight.pop(future)
                heavy_in_flight -= task.heavy
                exc = future.exception()
                if error is not None:
                    continue
                if exc is not None:
                    error = exc
                    continue
                if task.on_done is not None:
                    try:
                        task.on_done(future.result())
                    except BaseException as callback_error:  # noqa: BLE001 - raised below
                        error = callback_error
        self._light.clear()
        self._heavy.clear()
        if error is not None:
            raise error


class ProgressReporter:
    """Counts blobs and bytes confirmed, and calls the caller's callback (throttled)."""

    def __init__(
        self, callback: Callable[[TransferProgress], None] | None, *, min_interval_s: float = 0.1
    ) -> None:
        self._callback = callback
        self._min_interval_s = min_interval_s
        self._last = 0.0
        self._last_sent: TransferProgress | None = None
        self.files_done = self.files_total = self.bytes_done = self.bytes_total = 0

    def plan(self, files: int, nbytes: int) -> None:
        self.files_total += files
        self.bytes_total += nbytes

    def add(self, files: int = 0, nbytes: int = 0) -> None:
        self.files_done += files
        self.bytes_done += nbytes
        self.emit()

    def emit(self, *, force: bool = False) -> None:
        if self._callback is None:
            return
        now = time.monotonic()
        if not force and now - self._last < self._min_interval_s:
            return
        snapshot = self.snapshot()
        if snapshot == self._last_sent:
            return
        self._last = now
        self._last_sent = snapshot
        self._callback(snapshot)

    def snapshot(self) -> TransferProgress:
        return TransferProgress(self.files_done, self.files_total, self.bytes_done, self.bytes_total)


# ----------------------------------------------------------------------------------------------
# Blobs to move


@dataclass(frozen=True)
class BlobRef:
    """A blob to transfer and, for error messages, one bundle file that holds it."""

    sha256: str
    size: int
    bundle: str  # "name (uuid)"
    path: str


@dataclass
class TransferStats:
    """What a transfer really moved (logged after each push and pull)."""

    blobs_total: int = 0
    blobs_skipped: int = 0
    blobs_sent: int = 0
    parts_sent: int = 0
    parts_skipped: int = 0
    bytes_sent: int = 0


@dataclass(frozen=True)
class TransferSettings:
    part_size: int
    multipart_threshold: int
    max_in_flight: int
    upload_streams: int
    download_streams: int
    range_size: int


def part_size_for(size: int, part_size: int) -> int:
    """``part_size``, raised (to a whole MiB) when the blob would need more than 10,000 parts."""
    if math.ceil(size / part_size) <= MAX_PARTS:
        return part_size
    return math.ceil(size / MAX_PARTS / MIB) * MIB


# ----------------------------------------------------------------------------------------------
# Upload


@dataclass
class _Multipart:
    blob: BlobRef
    part_size: int
    upload_id: str = ""
    etags: dict[int, str] = field(default_factory=dict)
    remaining: int = 0
    exists: bool = False

    @property
    def part_count(self) -> int:
        return max(1, math.ceil(self.blob.size / self.part_size))

    def part_range(self, number: int) -> tuple[int, int]:
        start = (number - 1) * self.part_size
        return start, min(self.part_size, self.blob.size - start)


class _Transfer:
    """What an upload and a download share: the remote, the local context, the thread pool, the
    settings, where progress goes, and the stats of what really moved."""

    def __init__(
        self, remote: S3Remote, local: ContextDir, pool: Executor, settings: TransferSettings,
        progress: ProgressReporter,
    ) -> None:
        self.remote = remote
        self.local = local
        self.pool = pool
        self.settings = settings
        self.progress = progress
        self.stats = TransferStats()


class Uploader(_Transfer):
    """Pushes blobs of one local context to its remote."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._stats_lock = threading.Lock()
        self._recorded_uploads: set[str] = set()

    def upload(self, blobs: list[BlobRef]) -> TransferStats:
        """Make every blob present on the remote; raise on the first failure."""
        self.stats.blobs_total = len(blobs)
        self.progress.plan(len(blobs), sum(blob.size for blob in blobs))
        self.progress.emit(force=True)
        self._recorded_uploads = {path.stem for path in self.local.uploads.glob("*.json")}
        existing = self.remote.list_blobs() if len(blobs) >= LIST_THRESHOLD else None
        runner = TaskRunner(self.pool, max_in_flight=self.settings.max_in_flight,
                            max_heavy=self.settings.upload_streams)
        for blob in blobs:
            if existing is not None:
                found = existing.get(blob.sha256)
                if found is not None and found.size == blob.size:
                    self._skipped(blob)
                    continue
            if blob.size >= self.settings.multipart_threshold:
                self._add_multipart(runner, blob, check_remote=existing is None)
            else:
                runner.add(lambda blob=blob: self._put_whole(blob, check_remote=existing is None),
                           heavy=blob.size > HEAVY_BYTES,
                           on_done=lambda sent, blob=blob: self._whole_done(blob, sent))
        runner.run()
        self.progress.emit(force=True)
        return self.stats

    def _skipped(self, blob: BlobRef) -> None:
        if blob.sha256 in self._recorded_uploads:  # a stale upload: the remote's gc aborts it
            self.local.upload_state_path(blob.sha256).unlink(missing_ok=True)
        self.stats.blobs_skipped += 1
        self.progress.add(1, blob.size)

    # whole-object PUT ------------------------------------------------------------------------

    def _put_whole(self, blob: BlobRef, *, check_remote: bool) -> bool:
        key = self.remote.blob_key(blob.sha256)
        if check_remote:
            found = self.remote.stat(key)
            if found is not None and found.size == blob.size:
                return False
        data = self._read(blob, 0, blob.size)
        self.remote.put_bytes(key, data, sha256=blob.sha256, content_type=BLOB_CONTENT_TYPE)
        return True

    def _whole_done(self, blob: BlobRef, sent: bool) -> None:
        if not sent:
            self._skipped(blob)
            return
        self.stats.blobs_sent += 1
        self.stats.bytes_sent += blob.size
        self.progress.add(1, blob.size)

    def _read(self, blob: BlobRef, offset: int, length: int) -> bytes:
        path = self.local.blob_path(blob.sha256)
        try:
            with open(path, "rb") as handle:
                data = os.pread(handle.fileno(), length, offset)
        except FileNotFoundError:
            raise DataLoss(
                f"bundle {blob.bundle}: file {blob.path!r} has no local blob {blob.sha256} to push"
            ) from None
        if len(data) != length:
            raise DataLoss(
                f"bundle {blob.bundle}: the local blob of file {blob.path!r} (sha256 {blob.sha256}) is "
                f"truncated: expected {blob.size} bytes"
            )
        return data

    # multipart ---------------------------------------------------------------------------------

    def _add_multipart(self, runner: TaskRunner, blob: BlobRef, *, check_remote: bool) -> None:
        upload = _Multipart(blob, part_size_for(blob.size, self.settings.part_size))

        def prepared(_: None) -> None:
            if upload.exists:
                self._skipped(blob)
                return
            missing = [n for n in range(1, upload.part_count + 1) if n not in upload.etags]
            already = sum(upload.part_range(n)[1] for n in upload.etags)
            self.stats.parts_skipped += len(upload.etags)
            self.progress.add(0, already)
            upload.remaining = len(missing)
            if not missing:
                runner.add(lambda: self._complete(upload), on_done=lambda _: self._multipart_done(upload))
            for number in missing:
                runner.add(lambda number=number: self._upload_part(upload, number), heavy=True,
                           on_done=lambda nbytes: part_done(nbytes))

        def part_done(nbytes: int) -> None:
            self.stats.parts_sent += 1
            self.stats.bytes_sent += nbytes
            upload.remaining -= 1
            self.progress.add(0, nbytes)
            if upload.remaining == 0:
                runner.add(lambda: self._complete(upload), on_done=lambda _: self._multipart_done(upload))

        runner.add(lambda: self._prepare(upload, check_remote=check_remote), on_done=prepared)

    def _prepare(self, upload: _Multipart, *, check_remote: bool) -> None:
        """Resume the recorded upload of this blob if the remote still has it, else start one."""
        blob = upload.blob
        key = self.remote.blob_key(blob.sha256)
        state_path = self.local.upload_state_path(blob.sha256)
        state = _read_state(state_path)
        same = (state is not None and state.get("bucket") == self.remote.bucket and state.get("key") == key
                and state.get("size") == blob.size and isinstance(state.get("part_size"), int)
                and state["part_size"] > 0)
        if check_remote:
            found = self.remote.stat(key)
            if found is not None and found.size == blob.size:
                if same:
                    self._abort_quietly(key, state["upload_id"])
                state_path.unlink(missing_ok=True)
                upload.exists = True
                return
        if same:
            upload.part_size = state["part_size"]
            parts = self.remote.list_parts(key, state["upload_id"])
            if parts is not None:
                upload.upload_id = state["upload_id"]
                for number, part in parts.items():
                    if 1 <= number <= upload.part_count and part.size == upload.part_range(number)[1]:
                        upload.etags[number] = part.etag
                log.info("resuming the multipart upload of %s: %d of %d parts are already there",
                         key, len(upload.etags), upload.part_count)
                return
            upload.part_size = part_size_for(blob.size, self.settings.part_size)
        elif state is not None and state.get("bucket") == self.remote.bucket and isinstance(state.get("key"), str):
            self._abort_quietly(state["key"], state["upload_id"])
        state_path.unlink(missing_ok=True)
        upload.upload_id = self.remote.create_multipart(key)
        atomic_write(state_path, json.dumps({
            "bucket": self.remote.bucket, "key": key, "upload_id": upload.upload_id,
            "part_size": upload.part_size, "size": blob.size, "started": time.time(),
        }).encode())

    def _abort_quietly(self, key: str, upload_id: str) -> None:
        try:
            self.remote.abort_multipart(key, upload_id)
        except OpmlError as exc:  # the remote's gc aborts stale uploads anyway
            log.warning("could not abort the stale multipart upload %s of %s: %s", upload_id, key, exc)

    def _upload_part(self, upload: _Multipart, number: int) -> int:
        offset, length = upload.part_range(number)
        data = self._read(upload.blob, offset, length)
        etag = self.remote.upload_part(self.remote.blob_key(upload.blob.sha256), upload.upload_id, number, data)
        with self._stats_lock:
            upload.etags[number] = etag
        return length

    def _complete(self, upload: _Multipart) -> None:
        key = self.remote.blob_key(upload.blob.sha256)
        parts = sorted(upload.etags.items())
        try:
            self.remote.complete_multipart(key, upload.upload_id, parts)
        except Exception:
            # The parts may be gone or invalid: start over next time rather than loop on them.
            found = self.remote.stat(key)
            if found is None or found.size != upload.blob.size:
                self.local.upload_state_path(upload.blob.sha256).unlink(missing_ok=True)
                raise
        found = self.remote.stat(key)
        if found is None or found.size != upload.blob.size:
            self.local.upload_state_path(upload.blob.sha256).unlink(missing_ok=True)
            raise DataLoss(
                f"bundle {upload.blob.bundle}: after the multipart upload of file {upload.blob.path!r}, "
                f"{key!r} holds {None if found is None else found.size} bytes, expected {upload.blob.size}"
            )
        self.local.upload_state_path(upload.blob.sha256).unlink(missing_ok=True)

    def _multipart_done(self, upload: _Multipart) -> None:
        self.stats.blobs_sent += 1
        self.progress.add(1, 0)


def _read_state(path: Path) -> dict[str, Any] | None:
    try:
        state = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        log.warning("ignoring unreadable multipart upload state %s", path)
        path.unlink(missing_ok=True)
        return None
    return state if isinstance(state, dict) and isinstance(state.get("upload_id"), str) else None


# ----------------------------------------------------------------------------------------------
# Download


class _RangedBlob:
    """A blob downloaded as parallel ranges into one sparse file, hashed in order on the fly.

    Each range is written front to back; ``written[i]`` is how far range i got. sha256 is
    sequential, so one thread at a time (the holder of the hashing token) advances ``hashed``:
    a chunk that lands exactly at ``hashed`` is hashed right away from the receive buffer (still
    in the CPU cache); bytes that landed ahead of it are hashed from the page cache once the gap
    before them closes. Every byte is hashed by the time the last range task returns.
    """

    def __init__(self, blob: BlobRef, path: Path, range_size: int) -> None:
        self.blob = blob
        self.path = path
        self.range_size = range_size
        self.count = max(1, math.ceil(blob.size / range_size))
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, blob.size)
        self.hasher = hashlib.sha256()
        self.remaining = self.count  # ranges not yet downloaded (coordinating thread only)
        self.hashed = 0
        self._written = [0] * self.count
        self._lock = threading.Lock()
        self._hashing = False
        self._buffer: memoryview | None = None  # for page-cache hashing, used by the token holder

    def range_of(self, index: int) -> tuple[int, int]:
        start = index * self.range_size
        return start, min(self.range_size, self.blob.size - start)

    def landed(self, index: int, offset: int, view: memoryview) -> None:
        """Record ``view`` written at ``offset`` (in range ``index``) and hash what is in order."""
        with self._lock:
            self._written[index] = offset + len(view) - index * self.range_size
            if self._hashing or offset > self.hashed:
                return  # someone else hashes, or a gap before this chunk is still open
            self._hashing = True
            skip = self.hashed - offset  # part of this chunk already hashed from the page cache
        if skip < len(view):
            self.hasher.update(view[skip:])
        with self._lock:
            self.hashed = max(self.hashed, offset + len(view))
        self._drain()

    def _drain(self) -> None:
        """Hash bytes that landed ahead of ``hashed`` and are now in order; release the token."""
        while True:
            with self._lock:
                end = self._contiguous_end()
                if end <= self.hashed:
                    self._hashing = False
                    return
                start, end = self.hashed, min(end, self.hashed + 8 * MIB)
            if self._buffer is None:
                self._buffer = memoryview(bytearray(HASH_CHUNK))
            position = start
            while position < end:
                count = os.preadv(self.fd, [self._buffer[: min(HASH_CHUNK, end - position)]], position)
                if not count:
                    with self._lock:
                        self._hashing = False
                    raise OSError(f"short read at {position} of {self.path}")
                self.hasher.update(self._buffer[:count])
                position += count
            with self._lock:
                self.hashed = end

    def _contiguous_end(self) -> int:
        end = self.hashed
        index = end // self.range_size
        while index < self.count:
            start, length = self.range_of(index)
            end = start + self._written[index]
            if self._written[index] < length:
                break
            index += 1
        return max(end, self.hashed)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Downloader(_Transfer):
    """Pulls blobs of one context from its remote into ``objects/``, verified.

    Blobs download into ``tmp/``; once verified they are made durable together (one syncfs for
    many, an fsync each for few) and only then renamed into ``objects/``, so a blob in
    ``objects/`` always has its full, verified content. Blobs verified before a failure are
    still stored, so the next pull skips them.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._tmp_files: set[Path] = set()
        self._verified: list[tuple[Path, BlobRef]] = []
        self._lock = threading.Lock()

    def download(self, blobs: list[BlobRef]) -> TransferStats:
        """Fetch and verify every blob; raise DataLoss on the first mismatch."""
        self.stats.blobs_total = len(blobs)
        self.progress.plan(len(blobs), sum(blob.size for blob in blobs))
        self.progress.emit(force=True)
        runner = TaskRunner(self.pool, max_in_flight=self.settings.max_in_flight,
                            max_heavy=self.settings.download_streams)
        ranged: list[_RangedBlob] = []
        try:
            for blob in blobs:
                if blob.size > self.settings.range_size:
                    self._add_ranged(runner, blob, ranged)
                else:
                    runner.add(lambda blob=blob: self._get_whole(blob),
                               on_done=lambda _, blob=blob: self._blob_done(blob, blob.size))
            runner.run()
        finally:
            for item in ranged:
                item.close()
            try:
                self._publish_verified()
            finally:
                with self._lock:
                    for path in self._tmp_files:
                        path.unlink(missing_ok=True)
        self.progress.emit(force=True)
        return self.stats

    def _publish_verified(self) -> None:
        with self._lock:
            verified, self._verified = self._verified, []
        if not verified:
            return
        make_durable([tmp for tmp, _ in verified])
        directories: set[Path] = set()
        for tmp, blob in verified:
            target = self.local.blob_path(blob.sha256)
            target.parent.mkdir(exist_ok=True)
            os.replace(tmp, target)
            directories.add(target.parent)
            with self._lock:
                self._tmp_files.discard(tmp)
        for directory in directories:
            fsync_dir(directory)

    def _blob_done(self, blob: BlobRef, nbytes: int) -> None:
        self.stats.blobs_sent += 1
        self.stats.bytes_sent += nbytes
        self.progress.add(1, nbytes)

    def _new_tmp(self) -> Path:
        path = self.local.new_tmp_file()
        with self._lock:
            self._tmp_files.add(path)
        return path

    def _verified_tmp(self, tmp: Path, blob: BlobRef) -> None:
        with self._lock:
            self._verified.append((tmp, blob))

    def _missing_remote(self, blob: BlobRef) -> DataLoss:
        return DataLoss(
            f"bundle {blob.bundle}: file {blob.path!r} names blob {blob.sha256}, but the remote "
            f"{self.remote.url} has no object {self.remote.blob_key(blob.sha256)!r}"
        )

    def _mismatch(self, blob: BlobRef, actual_sha: str, actual_size: int) -> DataLoss:
        return DataLoss(
            f"bundle {blob.bundle}: file {blob.path!r} is corrupt on the remote {self.remote.url}: expected "
            f"sha256 {blob.sha256} ({blob.size} bytes), but the downloaded blob has sha256 {actual_sha} "
            f"({actual_size} bytes); it was not stored"
        )

    def _get_whole(self, blob: BlobRef) -> None:
        key = self.remote.blob_key(blob.sha256)
        tmp = self._new_tmp()
        hasher = hashlib.sha256()
        with open(tmp, "wb") as handle:

            def sink(view: memoryview) -> None:
                hasher.update(view)
                handle.write(view)

            try:
                size = self.remote.read_into(key, sink)
            except NotFound:
                raise self._missing_remote(blob) from None
        actual = hasher.hexdigest()
        if actual != blob.sha256 or size != blob.size:
            raise self._mismatch(blob, actual, size)
        self._verified_tmp(tmp, blob)

    def _add_ranged(self, runner: TaskRunner, blob: BlobRef, ranged: list[_RangedBlob]) -> None:
        def prepare() -> _RangedBlob | None:
            found = self.remote.stat(self.remote.blob_key(blob.sha256))
            if found is None:
                raise self._missing_remote(blob)
            if found.size != blob.size:
                self._get_whole(blob)  # raises DataLoss with both hashes
                return None
            item = _RangedBlob(blob, self._new_tmp(), self.settings.range_size)
            with self._lock:
                ranged.append(item)
            return item

        def prepared(item: _RangedBlob | None) -> None:
            if item is None:
                self._blob_done(blob, blob.size)
                return
            for index in range(item.count):
                runner.add(lambda index=index: self._get_range(item, index), heavy=True,
                           on_done=lambda nbytes: range_done(item, nbytes))

        def range_done(item: _RangedBlob, nbytes: int) -> None:
            self.stats.parts_sent += 1
            self.stats.bytes_sent += nbytes
            self.progress.add(0, nbytes)
            item.remaining -= 1
            if item.remaining == 0:
                runner.add(lambda: self._finish_ranged(item), on_done=lambda _: self._ranged_done(blob))

        runner.add(prepare, on_done=prepared)

    def _ranged_done(self, blob: BlobRef) -> None:
        self.stats.blobs_sent += 1
        self.progress.add(1, 0)

    def _get_range(self, item: _RangedBlob, index: int) -> int:
        start, length = item.range_of(index)
        key = self.remote.blob_key(item.blob.sha256)
        end = start + length
        offset = start

        def sink(view: memoryview) -> None:
            nonlocal offset
            if offset + len(view) > end:
                raise DataLoss(f"bundle {item.blob.bundle}: file {item.blob.path!r}: the remote sent more "
                               f"bytes than asked for in range {start}+{length} of {key!r}")
            os.pwrite(item.fd, view, offset)
            item.landed(index, offset, view)
            start_writeback(item.fd, offset, len(view))  # so the final fsync finds little left to do
            offset += len(view)

        try:
            self.remote.read_into(key, sink, offset=start, length=length)
        except NotFound:
            raise self._missing_remote(item.blob) from None
        if offset != end:
            raise DataLoss(f"bundle {item.blob.bundle}: file {item.blob.path!r}: the remote sent "
                           f"{offset - start} bytes for range {start}+{length} of {key!r}")
        return length

    def _finish_ranged(self, item: _RangedBlob) -> None:
        if item.hashed != item.blob.size:  # cannot happen: range tasks hash before they return
            raise RuntimeError(f"{item.blob.sha256}: {item.hashed} of {item.blob.size} bytes were hashed")
        actual = item.hasher.hexdigest()
        if actual != item.blob.sha256:
            raise self._mismatch(item.blob, actual, item.blob.size)
        item.close()
        self._verified_tmp(item.path, item.blob)
