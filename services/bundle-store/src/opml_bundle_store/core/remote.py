"""The S3 side of a context: its layout in a bucket and the requests the store makes there.

Under ``s3://bucket/prefix``::

    prefix/objects/<sha256>                 content-addressed blobs (one per distinct content)
    prefix/bundles/<name>/<uuid>.json       one manifest per pushed bundle version
    prefix/grants/revoked/<id>              an upload grant of a shared context, revoked (kept as long
                                            as a grant lives: grants.MAX_TTL_S)

A manifest is written only after every blob it names is in place, so a reader that sees a
manifest can fetch all of its files; a push that dies halfway leaves blobs but no manifest. Its
signature (:mod:`.signing`) is stored with it, in the object's metadata (``x-amz-meta-opml-hmac-sha256``):
one PUT writes both, and one GET reads both.

Most requests go through the public minio API. Uploads use minio's signer directly so the payload
hash need not be recomputed: a whole-blob PUT is signed with the sha256 the manifest already holds
(a real S3 or MinIO rejects the body if it does not match), and multipart parts are sent as
``UNSIGNED-PAYLOAD`` (the blob is verified against its sha256 on every pull).

Every method turns minio and urllib3 failures into platform errors: :class:`Unavailable`
(retriable: connection errors, 5xx, throttling), :class:`FailedPrecondition` (missing bucket,
refused credentials), :class:`DataLoss` (the server saw a body that does not match its hash).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlunsplit

import urllib3
from minio import Minio
from minio import time as minio_time
from minio.datatypes import Part
from minio.deleteobjects import DeleteObject
from minio.error import InvalidResponseError, MinioException, S3Error, ServerError
from minio.signer import sign_v4_s3

from opml_bundle_store.core.remote_url import format_remote_url, parse_remote_url
from opml_common.errors import DataLoss, FailedPrecondition, NotFound, OpmlError, Unavailable

log = logging.getLogger(__name__)

UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
BLOB_CONTENT_TYPE = "application/octet-stream"
MANIFEST_CONTENT_TYPE = "application/json"
MANIFEST_SIGNATURE_HEADER = "x-amz-meta-opml-hmac-sha256"
_RETRIABLE_CODES = {"InternalError", "SlowDown", "ServiceUnavailable", "RequestTimeout", "RequestTimeTooSkewed"}
_REFUSED_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled"}
_DIGEST_CODES = {"XAmzContentSHA256Mismatch", "BadDigest", "InvalidDigest"}


@contextlib.contextmanager
def translate_errors(what: str) -> Iterator[None]:
    """Turn S3 client failures inside the block into platform errors that say ``what`` failed."""
    try:
        yield
    except OpmlError:
        raise
    except S3Error as exc:
        raise error_from_s3(exc, what) from exc
    except (ServerError, InvalidResponseError) as exc:
        raise Unavailable(f"S3 failed to {what}: {exc}") from exc
    except (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError) as exc:
        raise Unavailable(f"S3 could not be reached to {what}: {exc}") from exc
    except MinioException as exc:
        raise Unavailable(f"S3 failed to {what}: {exc}") from exc


def error_from_s3(exc: S3Error, what: str) -> OpmlError:
    code = exc.code or ""
    detail = f"{code}: {exc.message}" if exc.message else code
    if code == "NoSuchBucket":
        return FailedPrecondition(f"cannot {what}: the bucket {exc.bucket_name!r} does not exist ({detail})")
    if code in ("NoSuchKey", "NoSuchUpload"):
        return NotFound(f"cannot {what}: {exc.object_name!r} does not exist ({detail})")
    if code in _REFUSED_CODES:
        return FailedPrecondition(f"cannot {what}: S3 refused the store's credentials ({detail})")
    if code in _DIGEST_CODES:
        return DataLoss(f"cannot {what}: S3 received a body that does not match its hash ({detail})")
    if code in _RETRIABLE_CODES:
        return Unavailable(f"S3 failed to {what} ({detail})")
    return OpmlError(f"S3 failed to {what} ({detail})")


_buffers = threading.local()
READ_BUFFER_SIZE = 4 * 1024 * 1024


def _body_chunks(response: Any) -> Iterator[memoryview]:
    """The body of a urllib3 response as views of a reused per-thread buffer."""
    buffer = getattr(_buffers, "buffer", None)
    if buffer is None:
        buffer = _buffers.buffer = memoryview(bytearray(READ_BUFFER_SIZE))
    raw = getattr(response, "_fp", None)
    encoded = response.headers.get("content-encoding", "identity").lower() not in ("", "identity")
    if raw is None or not hasattr(raw, "readinto") or encoded:
        for chunk in response.stream(READ_BUFFER_SIZE):  # the portable, allocating path
            yield memoryview(chunk)
        return
    while True:
        count = raw.readinto(buffer)
        if not count:
            return
        yield buffer[:count]


@dataclass(frozen=True)
class RemoteObject:
    key: str
    size: int
    last_modified: datetime | None


@dataclass(frozen=True)
class RemoteManifest:
    bundle_name: str
    uuid: str
    key: str
    staged: bool = False
    """An uncommitted bundle's manifest (under ``staging/``), not a committed one (under ``bundles/``)."""
    last_modified: datetime | None = None


@dataclass(frozen=True)
class StoredManifest:
    """A manifest's bytes as read from S3, and the signature stored with it (None: it has none)."""

    data: bytes
    signature: str | None


@dataclass(frozen=True)
class RemoteUpload:
    key: str
    upload_id: str
    initiated: datetime | None


class S3Remote:
    """One context's remote: a bucket and a key prefix, reached through a shared minio client.

    Thread-safe: it holds no mutable state besides the client's connection pool.
    """

    def __init__(self, client: Minio, url: str) -> None:
        self.client = client
        self.bucket, self.prefix = parse_remote_url(url)
        self.url = format_remote_url(self.bucket, self.prefix)
        self._base = f"{self.prefix}/" if self.prefix else ""

    # -- names ---------------------------------------------------------------------------------

    @property
    def objects_prefix(self) -> str:
        return f"{self._base}objects/"

    @property
    def bundles_prefix(self) -> str:
        return f"{self._base}bundles/"

    @property
    def staging_prefix(self) -> str:
        return f"{self._base}staging/"

    def blob_key(self, sha256: str) -> str:
        return f"{self.objects_prefix}{sha256}"

    def manifest_key(self, bundle_name: str, bundle_uuid: str) -> str:
        return f"{self.bundles_prefix}{bundle_name}/{bundle_uuid}.json"

    def staged_key(self, bundle_name: str, bundle_uuid: str) -> str:
        """Where a shared context keeps an uncommitted bundle's manifest until it is committed."""
        return f"{self.staging_prefix}{bundle_name}/{bundle_uuid}.json"

    @property
    def revoked_grants_prefix(self) -> str:
        return f"{self._base}grants/revoked/"

    def revoked_grant_key(self, grant_id: str) -> str:
        """Where a shared context records an upload grant's revocation (``grant_id`` checked first)."""
        return f"{self.revoked_grants_prefix}{grant_id}"

    # -- bucket --------------------------------------------------------------------------------

    def ensure_bucket(self) -> None:
        """Create the bucket unless it exists."""
        with translate_errors(f"create the bucket {self.bucket!r}"):
            if self.client.bucket_exists(self.bucket):
                return
            try:
                self.client.make_bucket(self.bucket)
            except S3Error as exc:
                if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    # -- listing -------------------------------------------------------------------------------

    def list_objects(self, prefix: str) -> Iterator[RemoteObject]:
        """Every object whose key starts with ``prefix`` (a full key prefix)."""
        with translate_errors(f"list {self.url}/{prefix[len(self._base):]}"):
            for item in self.client.list_objects(self.bucket, prefix=prefix, recursive=True):
                if item.is_dir or item.object_name is None:
                    continue
                yield RemoteObject(item.object_name, int(item.size or 0), item.last_modified)

    def list_blobs(self) -> dict[str, RemoteObject]:
        """Blobs on the remote by sha256."""
        start = len(self.objects_prefix)
        return {obj.key[start:]: obj for obj in self.list_objects(self.objects_prefix)
                if len(obj.key) - start == 64}

    def list_manifests(self, bundle_name: str | None = None, *, staged: bool = False) -> list[RemoteManifest]:
        """Manifests on the remote, optionally only the versions of one bundle name; with ``staged``,
        the staged (uncommitted) ones, listed before the committed ones so that a commit moving a
        bundle from one to the other while this lists is seen in at least one."""
        found = []
        for root, is_staged in ((self.staging_prefix, True), (self.bundles_prefix, False)):
            if is_staged and not staged:
                continue
            for obj in self.list_objects(root + (f"{bundle_name}/" if bundle_name else "")):
                name, _, file_name = obj.key[len(root):].partition("/")
                if not file_name.endswith(".json") or "/" in file_name:
                    continue
                found.append(RemoteManifest(name, file_name[: -len(".json")], obj.key, is_staged, obj.last_modified))
        return found

    def stat(self, key: str) -> RemoteObject | None:
        """The object's size and time, or None when it does not exist."""
        with translate_errors(f"look up {key!r}"):
            try:
                stat = self.client.stat_object(self.bucket, key)
            except S3Error as exc:
                if exc.code in ("NoSuchKey", "NoSuchObject", "ResourceNotFound"):
                    return None
                raise
        return RemoteObject(key, int(stat.size or 0), stat.last_modified)

    # -- reading -------------------------------------------------------------------------------

    def open(self, key: str, offset: int = 0, length: int = 0) -> Any:
        """A streaming response for the object (or a byte range); the caller closes it."""
        with translate_errors(f"read {key!r}"):
            return self.client.get_object(self.bucket, key, offset=offset, length=length)

    def read_into(self, key: str, sink: Callable[[memoryview], object], *, offset: int = 0, length: int = 0) -> int:
        """Stream the object (or a byte range) through ``sink`` and return the bytes read.

        Chunks are views of one reused per-thread buffer (valid only during the call), read with
        ``readinto`` from the connection: no allocation per chunk, and a fully read response
        leaves its connection in the pool for the next request.
        """
        return self._drain(self.open(key, offset, length), key, sink)

    def _drain(self, response: Any, key: str, sink: Callable[[memoryview], object]) -> int:
        total = 0
        consumed = False
        try:
            with translate_errors(f"read {key!r}"):
                for view in _body_chunks(response):
                    sink(view)
                    total += len(view)
            consumed = True
        finally:
            if not consumed:
                response.close()  # unread bytes would poison a pooled connection
            response.release_conn()
        return total

    def get_manifest(self, key: str, *, max_bytes: int) -> StoredManifest:
        """A manifest and its signature from one GET, read no further than ``max_bytes`` (anyone
        holding the bucket's credentials may have put any size there).

        Raises: DataLoss: the object holds more than ``max_bytes``.
        """
        data = bytearray()

        def sink(view: memoryview) -> None:
            if len(data) + len(view) > max_bytes:
                raise DataLoss(f"{key!r} holds more than {max_bytes} bytes; it was not read further")
            data.extend(view)

        response = self.open(key)
        signature = response.headers.get(MANIFEST_SIGNATURE_HEADER)
        self._drain(response, key, sink)
        return StoredManifest(bytes(data), signature)

    # -- writing -------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes, *, sha256: str | None, content_type: str) -> str:
        """PUT one object; ``sha256`` is the body's known hash (signed as is, never recomputed).

        Returns the ETag.
        """
        headers = {"Content-Type": content_type}
        with translate_errors(f"upload {key!r}"):
            response = self._signed_put(key, data, sha256 or UNSIGNED_PAYLOAD, headers, None)
        return response.headers.get("etag", "").replace('"', "")

    def put_manifest(self, key: str, data: bytes, *, signature: str, if_absent: bool = False) -> bool:
        """PUT a manifest with its signature in the object's metadata; with ``if_absent``, only if no
        object has that key (``If-None-Match: *``, which S3 decides atomically).

        Returns False when ``if_absent`` and the key was taken (nothing written), else True.
        """
        headers = {"Content-Type": MANIFEST_CONTENT_TYPE, MANIFEST_SIGNATURE_HEADER: signature}
        if if_absent:
            headers["If-None-Match"] = "*"
        with translate_errors(f"upload {key!r}"):
            try:
                self._signed_put(key, data, hashlib.sha256(data).hexdigest(), headers, None)
            except S3Error as exc:
                if if_absent and exc.code in ("PreconditionFailed", "ConditionalRequestConflict"):
                    return False
                raise
            except ServerError as exc:
                if if_absent and exc.status_code == 412:
                    return False
                raise
        return True

    def create_multipart(self, key: str) -> str:
        with translate_errors(f"start a multipart upload of {key!r}"):
            return self.client._create_multipart_upload(
                self.bucket, key, {"Content-Type": BLOB_CONTENT_TYPE}
            )

    def list_parts(self, key: str, upload_id: str) -> dict[int, Part] | None:
        """Parts already uploaded, by part number; None when the upload no longer exists."""
        parts: dict[int, Part] = {}
        marker: str | None = None
        with translate_errors(f"list the uploaded parts of {key!r}"):
            while True:
                try:
                    result = self.client._list_parts(
                        self.bucket, key, upload_id, part_number_marker=marker
                    )
                except S3Error as exc:
                    if exc.code in ("NoSuchUpload", "NoSuchKey"):
                        return None
                    raise
                for part in result.parts:
                    parts[part.part_number] = part
                if not result.is_truncated or not result.next_part_number_marker:
                    return parts
                marker = result.next_part_number_marker

    def upload_part(self, key: str, upload_id: str, part_number: int, data: bytes) -> str:
        """Upload one part (unsigned payload); returns its ETag."""
        with translate_errors(f"upload part {part_number} of {key!r}"):
            response = self._signed_put(
                key, data, UNSIGNED_PAYLOAD, {},
                {"partNumber": str(part_number), "uploadId": upload_id},
            )
        return response.headers.get("etag", "").replace('"', "")

    def complete_multipart(self, key: str, upload_id: str, parts: list[tuple[int, str]]) -> None:
        with translate_errors(f"complete the multipart upload of {key!r}"):
            self.client._complete_multipart_upload(
                self.bucket, key, upload_id, [Part(number, etag) for number, etag in sorted(parts)]
            )

    def abort_multipart(self, key: str, upload_id: str) -> None:
        with translate_errors(f"abort the multipart upload of {key!r}"):
            try:
                self.client._abort_multipart_upload(self.bucket, key, upload_id)
            except S3Error as exc:
                if exc.code not in ("NoSuchUpload", "NoSuchKey"):
                    raise

    def list_uploads(self, prefix: str) -> Iterator[RemoteUpload]:
        """Multipart uploads in progress under ``prefix`` (a full key prefix)."""
        key_marker: str | None = None
        upload_marker: str | None = None
        with translate_errors(f"list the multipart uploads under {prefix!r}"):
            while True:
                result = self.client._list_multipart_uploads(
                    self.bucket, prefix=prefix, key_marker=key_marker, upload_id_marker=upload_marker,
                )
                for upload in result.uploads:
                    yield RemoteUpload(upload.object_name, upload.upload_id or "", upload.initiated_time)
                if not result.is_truncated or not result.uploads:
                    return
                key_marker = result.next_key_marker or result.uploads[-1].object_name
                upload_marker = result.uploads[-1].upload_id

    def delete(self, keys: Iterable[str]) -> None:
        """Delete objects (in batches of 1000); missing ones are fine."""
        with translate_errors(f"delete objects from {self.url}"):
            errors = list(self.client.remove_objects(self.bucket, (DeleteObject(key) for key in keys)))
        failed = [error for error in errors if error.code not in ("NoSuchKey",)]
        if failed:
            first = failed[0]
            raise Unavailable(
                f"S3 failed to delete {len(failed)} objects from {self.url}, "
                f"the first {first.name!r}: {first.code} {first.message}"
            )

    # -- signed requests -----------------------------------------------------------------------

    def _signed_put(
        self, key: str, body: bytes, content_sha256: str, headers: dict[str, str], query: dict[str, str] | None,
    ) -> Any:
        """PUT signed (SigV4) with a payload hash given by the caller; minio would rehash the body."""
        client = self.client
        region = client._get_region(self.bucket)
        url = client._base_url.build(
            method="PUT", region=region, bucket_name=self.bucket, object_name=key, query_params=query,
        )
        date = minio_time.utcnow()
        request_headers: dict[str, Any] = {
            **headers,
            "Host": url.netloc,
            "User-Agent": client._user_agent,
            "Content-Length": str(len(body)),
            "x-amz-date": minio_time.to_amz_date(date),
        }
        creds = client._provider.retrieve() if client._provider else None
        if creds is not None:
            request_headers["x-amz-content-sha256"] = content_sha256
            if creds.session_token:
                request_headers["X-Amz-Security-Token"] = creds.session_token
            request_headers = sign_v4_s3(
                method="PUT", url=url, region=region, headers=request_headers,
                credentials=creds, content_sha256=content_sha256, date=date,
            )
        response = client._http.urlopen(
            "PUT", urlunsplit(url), body=body, headers=request_headers, preload_content=True,
        )
        if response.status == 200:
            return response
        content_type = response.headers.get("content-type", "")
        if response.data and "xml" in content_type:
            error = S3Error.fromxml(response)
            if error.object_name is None:
                error = S3Error(response, error.code, error.message, error.resource, error.request_id,
                                error.host_id, self.bucket, key)
            raise error
        raise ServerError(f"PUT {key!r} failed with HTTP status {response.status}", response.status)
