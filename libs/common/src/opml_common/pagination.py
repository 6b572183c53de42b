"""List pagination (AIP-158): page_size with a default and a cap, opaque page tokens."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from typing import TypeVar

from opml_common.errors import InvalidArgument

T = TypeVar("T")


def paginate(items: Sequence[T], page_size: int, page_token: str, *, query: str = "",
             default_size: int = 100, max_size: int = 1000) -> tuple[Sequence[T], str]:
    """One page of ``items`` and the token of the next page ('' on the last page).

    The token binds the offset to ``query`` (the request's filters), so a token reused with other
    filters is rejected rather than silently skipping items. Sizes above ``max_size`` are capped.
    """
    if page_size < 0:
        raise InvalidArgument("page_size", f"must be >= 0, but got {page_size}")
    size = min(page_size or default_size, max_size)
    offset = _decode(page_token, query) if page_token else 0
    page = items[offset:offset + size]
    end = offset + len(page)
    return page, (_encode(end, query) if end < len(items) else "")


def _fingerprint(query: str) -> str:
    return hashlib.sha256(query.encode()).hexdigest()[:8]


def _encode(offset: int, query: str) -> str:
    return base64.urlsafe_b64encode(f"{offset}:{_fingerprint(query)}".encode()).decode()


def _decode(token: str, query: str) -> int:
    try:
        offset_text, fingerprint = base64.urlsafe_b64decode(token.encode()).decode().split(":")
        offset = int(offset_text)
    except ValueError:
        raise InvalidArgument("page_token", f"is not a token this service issued: {token!r}") from None
    if fingerprint != _fingerprint(query) or offset < 0:
        raise InvalidArgument("page_token", "was issued for a request with other filters; start from the first page")
    return offset
