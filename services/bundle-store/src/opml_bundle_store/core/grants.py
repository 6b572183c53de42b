"""Upload grants: bearer tokens the store signs, each letting its holder add one bundle name to one context.

A job that makes a bundle (an automl trial's model) must not hold the platform's writer token, which
could overwrite or read every context. Its submitter asks the store for a grant instead
(``CreateUploadGrant``) and hands the job only that. A grant names one context, one bundle name, the
most bytes one upload may declare, and when it expires; with it, its holder may ``AddBundle`` that
name into that context, uncommitted (a commit is what the platform acts on: autodeploy, monitoring;
the grant's issuer commits what it accepts), and ``GetBundle``/``ListBundles`` versions of it,
nothing else.

The token is self-contained: ``opmlgrant1.<payload>.<signature>``, the payload the grant as compact
JSON (base64url, no padding), the signature an HMAC-SHA256 of the payload with :class:`GrantKeys`
(purpose-tagged, so no manifest signature passes for a grant). The store keeps no state for it, so any
replica holding the same keys accepts it, and a restart loses none; only a revocation is kept, with the
grant's context (:meth:`BundleStore.revoke_upload_grant`: on the remote of a shared context), so every
replica refuses a revoked grant at its next call. Its id (random, in the payload)
names it in logs and audit lines (the principal ``upload-grant:{id}``); the token itself is never
logged nor quoted in an error.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from opml_bundle_store.core.signing import SigningKeys
from opml_common.errors import InvalidArgument, Unauthenticated

TOKEN_PREFIX = "opmlgrant1."
"""What every grant starts with (and no configured token need): how the store tells one apart."""
MAX_TOKEN_CHARS = 2048
"""Longer bearer tokens are not grants (bounded before any decoding)."""
MAX_TTL_S = 7 * 24 * 3600
_PURPOSE = "opml.bundles.v1.upload-grant"
_GRANT_ID = re.compile(r"[0-9a-f]{16}")


class GrantKeys(SigningKeys):
    """The keys that sign (the first) and verify (any) upload grants; every replica holds the same."""

    what = "grant key"
    file_name = "grant.key"


@dataclass(frozen=True, slots=True)
class UploadGrant:
    """What one grant allows: add ``bundle_name`` into ``context_id``, each upload at most ``max_bytes``,
    until ``expires_at`` (Unix seconds)."""

    grant_id: str
    context_id: str
    bundle_name: str
    max_bytes: int
    expires_at: float

    @property
    def principal_name(self) -> str:
        return f"upload-grant:{self.grant_id}"

    def describe(self) -> str:
        """How messages name it (never the token)."""
        return (f"upload grant {self.grant_id} (bundle {self.bundle_name!r} in context "
                f"{self.context_id!r})")


def issue(keys: GrantKeys, *, context_id: str, bundle_name: str, max_bytes: int, ttl_s: int,
          now: float) -> tuple[str, UploadGrant]:
    """A new grant and its token (the caller checked the context, name and bounds)."""
    grant = UploadGrant(grant_id=secrets.token_hex(8), context_id=context_id, bundle_name=bundle_name,
                        max_bytes=max_bytes, expires_at=float(int(now) + ttl_s))
    payload = json.dumps({"id": grant.grant_id, "ctx": context_id, "name": bundle_name, "max": max_bytes,
                          "exp": int(grant.expires_at)}, separators=(",", ":"), sort_keys=True).encode()
    encoded = _b64(payload)
    return f"{TOKEN_PREFIX}{encoded}.{keys.mac((_PURPOSE,), encoded.encode())}", grant


def verify(keys: GrantKeys, token: str, *, now: float) -> UploadGrant | None:
    """The grant ``token`` stands for; None when it is no grant (no :data:`TOKEN_PREFIX`).

    Raises:
        Unauthenticated: a grant no key signed (tampered, forged, or signed by a retired key), one that
            does not parse, or one that expired (its id named; never the token).
    """
    if not token.startswith(TOKEN_PREFIX):
        return None
    body = token[len(TOKEN_PREFIX):]
    encoded, _, signature = body.partition(".")
    if len(token) > MAX_TOKEN_CHARS or not signature or not keys.verifies((_PURPOSE,), encoded.encode(), signature):
        raise Unauthenticated("the upload grant presented does not verify (tampered with, or not issued by "
                              "this bundle-store's grant keys); ask for a new one")
    try:
        fields = json.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
        grant = UploadGrant(grant_id=str(fields["id"]), context_id=str(fields["ctx"]),
                            bundle_name=str(fields["name"]), max_bytes=int(fields["max"]),
                            expires_at=float(fields["exp"]))
    except (ValueError, KeyError, TypeError, binascii.Error):  # signed by us, so only an older format
        raise Unauthenticated("the upload grant presented is of a format this bundle-store does not read; "
                              "ask for a new one") from None
    if now >= grant.expires_at:
        raise Unauthenticated(f"upload grant {grant.grant_id} expired; ask for a new one")
    return grant


def validate_grant_id(value: Any, field: str = "grant_id") -> str:
    """A grant's id as :func:`issue` makes it: 16 lowercase hex digits (so it names a file or an S3 key as is)."""
    if not isinstance(value, str) or not _GRANT_ID.fullmatch(value):
        raise InvalidArgument(field, f"`{field}` must be an upload grant's id, 16 lowercase hex digits, but got "
                                     f"{value!r:.40}")
    return value


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")
