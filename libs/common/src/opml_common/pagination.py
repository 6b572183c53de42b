"""List pagination (AIP-158): page_size with a default and a cap, opaque page tokens.

Two kinds of token, both bound to the request's filters: an offset into the list (:func:`paginate`),
or a cursor, the last item's place in the list's order (:func:`cursor_token`, :func:`read_cursor`),
for a list that grows or shrinks between pages or is read from an index a page at a time.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Sequence
from typing import TypeVar

from opml_common.errors import InvalidArgument, brief

T = TypeVar("T")


def paginate(items: Sequence[T], page_size: int, page_token: str, *, query: str = "",
             default_size: int = 100, max_size: int = 1000) -> tuple[Sequence[T], str]:
    """One page of ``items`` and the token of the next page ('' on the last page).

    The token binds the offset to ``query`` (the request's filters), so a token reused with other
    filters is rejected rather than silently skipping items. Sizes above ``max_size`` are capped.
    """
    size = page_size_of(page_size, default_size=default_size, max_size=max_size)
    offset = _decode(page_token, query) if page_token else 0
    page = items[offset:offset + size]
    end = offset + len(page)
    return page, (_encode(end, query) if end < len(items) else "")


def page_size_of(page_size: int, *, default_size: int = 100, max_size: int = 1000) -> int:
    """The size of the page to answer: ``default_size`` for 0, at most ``max_size``.

    Raises: InvalidArgument: ``page_size`` is negative."""
    if page_size < 0:
        raise InvalidArgument("page_size", f"must be >= 0, but got {page_size}")
    return min(page_size or default_size, max_size)


def cursor_token(cursor: Sequence[int | str], query: str = "") -> str:
    """A token holding ``cursor`` (the last item's place: ints and strings), bound to ``query``."""
    return base64.urlsafe_b64encode(json.dumps([_fingerprint(query), *cursor]).encode()).decode()


def read_cursor(token: str, shape: Sequence[type], query: str = "") -> tuple:
    """The cursor :func:`cursor_token` put in ``token``, each part of the type ``shape`` names.

    Raises: InvalidArgument: ``page_token`` was not given by this API, or for other filters."""
    try:
        fingerprint, *parts = json.loads(base64.urlsafe_b64decode(token.encode()))
        if len(parts) != len(shape) or not all(type(part) is kind for part, kind in zip(parts, shape, strict=True)):
            raise ValueError(token)
    except (ValueError, TypeError):
        raise InvalidArgument("page_token", f"is not a token this service issued: {brief(token)}") from None
    if fingerprint != _fingerprint(query):
        raise InvalidArgument("page_token", "was issued for a request with other filters; start from the first page")
    return tuple(parts)


def _fingerprint(query: str) -> str:
    return hashlib.sha256(query.encode()).hexdigest()[:8]


def _encode(offset: int, query: str) -> str:
    return base64.urlsafe_b64encode(f"{offset}:{_fingerprint(query)}".encode()).decode()


def _decode(token: str, query: str) -> int:
    try:
        offset_text, fingerprint = base64.urlsafe_b64decode(token.encode()).decode().split(":")
        offset = int(offset_text)
    except ValueError:
        raise InvalidArgument("page_token", f"is not a token this service issued: {brief(token)}") from None
    if fingerprint != _fingerprint(query) or offset < 0:
        raise InvalidArgument("page_token", "was issued for a request with other filters; start from the first page")
    return offset
