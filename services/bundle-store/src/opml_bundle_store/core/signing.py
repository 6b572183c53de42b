"""Signatures of remote manifests: an HMAC-SHA256 with a key that only bundle-stores hold.

Anyone who can write a context's bucket can put a well-formed manifest there (a canonical uuid, a
right content hash): the content hash says what a bundle holds, not who made it. A push signs each
manifest it writes; a pull verifies the signature before it parses the manifest, and refuses one
without a valid signature. The signature covers the manifest's exact bytes and the bundle name and
uuid of its key, so a signed manifest copied under another name or uuid does not verify.

Keys rotate: the first key signs, every key verifies. Every store that pushes to or pulls from a
remote holds the same keys. A store given none keeps one of its own in its home
(:meth:`ManifestKeys.kept_in`), which is enough for one store and for pulls back into it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from opml_bundle_store.core.layout import fsync_dir, tmp_name
from opml_common.errors import FailedPrecondition

MIN_KEY_CHARS = 32
KEY_FILE_NAME = "manifest.key"
_PURPOSE = "opml.bundles.v1.manifest"


class SigningKeys:
    """HMAC keys: the first signs, any verifies. Never shown in a repr. Subclasses say what they sign
    (``what``, in messages) and the file a store keeps its own key in (``file_name``).

    Raises:
        ValueError: no key, or a key shorter than MIN_KEY_CHARS (named by position, never shown).
    """

    what = "key"
    file_name = "signing.key"

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError(f"no {self.what} is given")
        for index, key in enumerate(keys, 1):
            if len(key) < MIN_KEY_CHARS or any(char.isspace() or char == "," for char in key):
                raise ValueError(f"{self.what} {index} must be at least {MIN_KEY_CHARS} characters without "
                                 "spaces or commas (make one with `openssl rand -hex 32`)")
        self._keys = tuple(key.encode() for key in keys)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self._keys)} keys)"

    @classmethod
    def parse(cls, text: str) -> Self:
        """Keys separated by commas or line breaks (blank entries ignored), the signing key first."""
        return cls([key.strip() for line in text.splitlines() for key in line.split(",") if key.strip()])

    @classmethod
    def from_file(cls, path: Path) -> Self:
        """The keys in ``path`` (as :meth:`parse` reads them). Raises ValueError, OSError."""
        return cls.parse(path.read_text(encoding="utf-8"))

    @classmethod
    def kept_in(cls, home: Path) -> Self:
        """The key a store keeps in ``home/{file_name}``: made once (mode 0600), then read at every
        open. The caller holds the home's lock.

        Raises: FailedPrecondition (the file holds no valid key), OSError.
        """
        path = home / cls.file_name
        if not path.exists():
            tmp = tmp_name(path)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as handle:
                    handle.write(secrets.token_hex(32) + "\n")
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            fsync_dir(home)
        try:
            return cls.from_file(path)
        except ValueError as exc:
            raise FailedPrecondition(f"{path} holds no valid {cls.what} ({exc}): remove it and a new one is "
                                     f"made, but what the old one signed no longer verifies") from None

    def mac(self, header: Sequence[str], data: bytes) -> str:
        """The HMAC-SHA256 (hex), with the signing key, of ``data`` under the JSON ``header`` (its
        purpose and what names the data)."""
        return _mac(self._keys[0], header, data)

    def verifies(self, header: Sequence[str], data: bytes, signature: str) -> bool:
        """Whether any key made ``signature`` of exactly this header and data (constant-time compare)."""
        given = signature.encode("ascii", "replace")
        return any(hmac.compare_digest(_mac(key, header, data).encode(), given) for key in self._keys)


class ManifestKeys(SigningKeys):
    """The keys that sign (the first) and verify (any) remote manifests."""

    what = "manifest key"
    file_name = KEY_FILE_NAME

    def sign(self, bundle_name: str, bundle_uuid: str, data: bytes, *, staged: bool = False) -> str:
        """The signature (hex) of the manifest ``data`` stored under ``bundle_name`` and ``bundle_uuid``;
        ``staged``: an uncommitted bundle's (signed under its own tag, so a staged manifest copied to a
        committed key does not verify there)."""
        return self.mac(_header(bundle_name, bundle_uuid, staged), data)

    def verify(self, bundle_name: str, bundle_uuid: str, data: bytes, signature: str, *, staged: bool = False) -> bool:
        """Whether any key signed exactly this manifest under this name and uuid (compared in constant time)."""
        return self.verifies(_header(bundle_name, bundle_uuid, staged), data, signature)


def _header(bundle_name: str, bundle_uuid: str, staged: bool) -> tuple[str, ...]:
    return (_PURPOSE, bundle_name, bundle_uuid, "staged") if staged else (_PURPOSE, bundle_name, bundle_uuid)


def _mac(key: bytes, header: Sequence[str], data: bytes) -> str:
    # The JSON header is unambiguous (its strings are escaped, it holds no raw line break), so no name
    # and uuid can be shifted into the data's bytes or back, and its purpose keeps one kind of
    # signature from passing for another.
    mac = hmac.new(key, json.dumps(list(header)).encode() + b"\n", hashlib.sha256)
    mac.update(data)
    return mac.hexdigest()
