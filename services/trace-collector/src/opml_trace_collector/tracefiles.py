"""The capture traces in S3: the bucket, reading an object whole or in chunks (for FetchTrace)."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator

from minio import Minio
from minio.error import S3Error

from opml_common.errors import NotFound
from opml_trace_collector.analysis import TraceTooBig

CHUNK_BYTES = 1024 * 1024
_MISSING = ("NoSuchKey", "NoSuchBucket", "NoSuchObject", "NotFound")


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> (bucket, key)."""
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return bucket, key


class TraceFiles:
    """Blocking S3 access (call from a thread): traces live at ``s3://{bucket}/traces/...``."""

    def __init__(self, s3: Minio, bucket: str) -> None:
        self.s3 = s3
        self.bucket = bucket

    def ensure_bucket(self) -> None:
        """Create the traces bucket if missing, so tracers can upload from the first capture."""
        if not self.s3.bucket_exists(self.bucket):
            try:
                self.s3.make_bucket(self.bucket)
            except S3Error as exc:
                if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    @staticmethod
    def armed_key(job: str, capture_id: str) -> str:
        """Where the service records that it armed a capture: ``captures/{job}/{capture_id}.armed``.

        Outside ``traces/``, the only prefix the tracers write: a tracer's S3 credential can be scoped
        so that it cannot make a capture look armed.
        """
        return f"captures/{job}/{capture_id}.armed"

    def mark_armed(self, job: str, capture_id: str, request: dict) -> None:
        """Record that this service armed ``capture_id`` of ``job`` (``request``: its facts, as JSON)."""
        data = json.dumps(request, sort_keys=True).encode()
        self.s3.put_object(self.bucket, self.armed_key(job, capture_id), io.BytesIO(data), len(data),
                           content_type="application/json")

    def was_armed(self, job: str, capture_id: str) -> bool:
        """Whether :meth:`mark_armed` recorded ``capture_id`` of ``job`` (the same job: a mark names it)."""
        try:
            self.s3.stat_object(self.bucket, self.armed_key(job, capture_id))
        except S3Error as exc:
            if exc.code in _MISSING:
                return False
            raise
        return True

    def chunks(self, url: str) -> Iterator[bytes]:
        """The object's bytes in chunks of at most CHUNK_BYTES.

        Raises:
            NotFound: the object is gone.
        """
        bucket, key = parse_s3_url(url)
        try:
            response = self.s3.get_object(bucket, key)
        except S3Error as exc:
            if exc.code in _MISSING:
                raise NotFound(f"trace {url} is not in S3 any more") from exc
            raise
        try:
            yield from response.stream(CHUNK_BYTES)
        finally:
            response.close()
            response.release_conn()

    def read(self, url: str, *, max_bytes: int | None = None) -> bytes:
        """The whole object (a trace to analyze), if it is at most ``max_bytes`` (None: any size).

        Raises:
            NotFound: as :meth:`chunks`.
            TraceTooBig: the object is over ``max_bytes``: its size is checked before it is read,
                and the read stops past it (the object may be replaced in between).
        """
        if max_bytes is not None:
            bucket, key = parse_s3_url(url)
            try:
                size = self.s3.stat_object(bucket, key).size
            except S3Error as exc:
                if exc.code in _MISSING:
                    raise NotFound(f"trace {url} is not in S3 any more") from exc
                raise
            if size is not None and size > max_bytes:
                raise TraceTooBig(f"the trace object is {size} bytes, over the {max_bytes} bytes analyzed here")
        data = bytearray()
        with contextlib.closing(self.chunks(url)) as chunks:
            for chunk in chunks:
                data += chunk
                if max_bytes is not None and len(data) > max_bytes:
                    raise TraceTooBig(f"the trace object is over the {max_bytes} bytes analyzed here")
        return bytes(data)
