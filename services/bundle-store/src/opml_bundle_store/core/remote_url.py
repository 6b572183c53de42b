"""Where a context's remote is: ``s3://bucket/prefix``, parsed, checked and written in its canonical form."""

from __future__ import annotations

import re
from typing import Any

from opml_bundle_store.core.manifest import shown
from opml_common.errors import InvalidArgument

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def parse_remote_url(value: Any, field: str = "remote_url") -> tuple[str, str]:
    """Split ``s3://bucket/prefix`` into ``(bucket, prefix)``; prefix has no leading or trailing '/'.

    Rules: scheme ``s3``; the bucket is an S3 bucket name (3-63 characters: lowercase letters,
    digits, '.', '-', starting and ending with a letter or digit, no '..'); the optional prefix is
    '/'-separated with no empty (other than one trailing '/'), '.' or '..' segments.
    """
    example = "s3://my-bucket/some/prefix"
    if not isinstance(value, str) or not value.startswith("s3://"):
        raise InvalidArgument(field, f"`{field}` must look like {example!r}, but got {shown(value)}.")
    bucket, _, prefix = value[len("s3://"):].partition("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket or re.fullmatch(r"[0-9.]+", bucket):
        raise InvalidArgument(
            field,
            f"`{field}` must name an S3 bucket of 3-63 lowercase letters, digits, '.' or '-' "
            f"(like {example!r}), but got the bucket {bucket!r} in {shown(value)}.",
        )
    prefix = prefix.removesuffix("/")
    if prefix:
        for segment in prefix.split("/"):
            if segment in ("", ".", "..") or "\x00" in segment:
                raise InvalidArgument(
                    field,
                    f"`{field}` prefix must be '/'-separated with no empty, '.' or '..' segments, "
                    f"but got {shown(value)}.",
                )
    return bucket, prefix


def format_remote_url(bucket: str, prefix: str) -> str:
    """The canonical ``s3://bucket/prefix`` (no trailing '/'); inverse of :func:`parse_remote_url`."""
    return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"


def normalize_remote_url(value: str | None, field: str = "remote_url") -> str | None:
    """Validate a remote URL and return its canonical form; None or '' means no remote."""
    if value is None or value == "":
        return None
    return format_remote_url(*parse_remote_url(value, field))
