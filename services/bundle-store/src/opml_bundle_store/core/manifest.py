"""Bundles and their parts as immutable values, their JSON manifest and their content hash.

A bundle (after Intuit's Disdat) is a versioned, immutable, typed collection of files and scalar
values with lineage. Every version of a bundle shares its ``name`` and has its own ``uuid``.
Files live in content-addressed blobs named by their sha256; the manifest (this module's JSON)
lists them. ``content_hash`` identifies the content: equal files (path, sha256) and equal typed
values give an equal hash, whatever the tags, lineage or times.

The rules an input must follow before it becomes one of these values are in :mod:`.rules`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from opml_bundle_store_contract.values import Value
from opml_common.errors import InvalidArgument

MANIFEST_FORMAT = 1
DEFAULT_MEDIA_TYPE = "application/octet-stream"

_EMPTY: Mapping[str, Any] = MappingProxyType({})


# ----------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True)
class FileEntry:
    """One file of a bundle: its path inside the bundle and the blob holding its bytes."""

    path: str
    sha256: str
    size: int
    media_type: str = DEFAULT_MEDIA_TYPE


@dataclass(frozen=True)
class Lineage:
    """Where a bundle came from: the bundles it was computed from and how."""

    input_uuids: tuple[str, ...] = ()
    code_version: str = ""
    parameters: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    creator: str = ""
    start_time: datetime | None = None
    stop_time: datetime | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_uuids", tuple(self.input_uuids))
        object.__setattr__(self, "parameters", MappingProxyType(dict(self.parameters)))


@dataclass(frozen=True)
class Bundle:
    """One version of a bundle, as the store holds it locally.

    ``committed``, ``commit_time``, ``remote_url`` and ``localized`` are the local state of the
    version; everything else is fixed when the bundle is added. ``remote_url`` is the remote the
    version was last pushed to or pulled from; ``localized`` is true when every file's blob is
    present in the local store (false after a metadata-only pull).
    """

    context: str
    name: str
    uuid: str
    tags: Mapping[str, str]
    files: tuple[FileEntry, ...]
    values: Mapping[str, Value]
    lineage: Lineage
    content_hash: str
    committed: bool
    create_time: datetime
    commit_time: datetime | None
    remote_url: str | None
    localized: bool
    idempotency_key: str = ""
    """The key the add carried ('' : none): an add of the same name and key returns this bundle."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tags", MappingProxyType(dict(self.tags)))
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))
        object.__setattr__(self, "files", tuple(self.files))

    @property
    def resource_name(self) -> str:
        """``contexts/{context}/bundles/{uuid}`` (AIP-122)."""
        return f"contexts/{self.context}/bundles/{self.uuid}"

    @property
    def size(self) -> int:
        """Total bytes of the bundle's files."""
        return sum(entry.size for entry in self.files)

    def file(self, path: str) -> FileEntry | None:
        """The file at ``path``, or None."""
        return next((entry for entry in self.files if entry.path == path), None)

    # -- manifest ------------------------------------------------------------------------------

    def to_manifest(self, *, local_state: bool = True) -> dict[str, Any]:
        """The manifest as a JSON-able dict. ``local_state=False`` leaves out ``remote_url`` and
        ``localized``, which describe one store's copy (remote manifests are written that way)."""
        doc: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "context": self.context,
            "name": self.name,
            "uuid": self.uuid,
            "tags": dict(sorted(self.tags.items())),
            "files": [
                {"path": f.path, "sha256": f.sha256, "size": f.size, "media_type": f.media_type}
                for f in self.files
            ],
            "values": {key: _encode_value(value) for key, value in sorted(self.values.items())},
            "lineage": {
                "input_uuids": list(self.lineage.input_uuids),
                "code_version": self.lineage.code_version,
                "parameters": dict(sorted(self.lineage.parameters.items())),
                "creator": self.lineage.creator,
                "start_time": _time_to_json(self.lineage.start_time),
                "stop_time": _time_to_json(self.lineage.stop_time),
            },
            "content_hash": self.content_hash,
            "committed": self.committed,
            "create_time": _time_to_json(self.create_time),
            "commit_time": _time_to_json(self.commit_time),
        }
        if self.idempotency_key:  # written only when set: manifests without one keep their bytes
            doc["idempotency_key"] = self.idempotency_key
        if local_state:
            doc["remote_url"] = self.remote_url
            doc["localized"] = self.localized
        return doc

    def to_json(self, *, local_state: bool = True) -> bytes:
        """The manifest as UTF-8 JSON bytes (bytes values base64, times ISO 8601 UTC)."""
        return json.dumps(self.to_manifest(local_state=local_state), indent=1, ensure_ascii=False).encode()

    @classmethod
    def from_manifest(cls, doc: Mapping[str, Any], *, context: str | None = None) -> Bundle:
        """Rebuild a bundle from :meth:`to_manifest` output. ``context`` overrides the context
        recorded in the manifest (a bundle pulled into another context takes that context's id).

        Raises:
            ValueError: the manifest is malformed or of an unknown format.
        """
        try:
            if doc.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"unknown manifest format {doc.get('format')!r}")
            lineage = doc.get("lineage") or {}
            return cls(
                context=context if context is not None else str(doc["context"]),
                name=str(doc["name"]),
                uuid=str(doc["uuid"]),
                tags={str(k): str(v) for k, v in (doc.get("tags") or {}).items()},
                files=tuple(
                    FileEntry(str(f["path"]), str(f["sha256"]), _int_from_json(f["size"], "a file's size"),
                              str(f.get("media_type") or DEFAULT_MEDIA_TYPE))
                    for f in doc["files"]
                ),
                values={str(k): _decode_value(v) for k, v in (doc.get("values") or {}).items()},
                lineage=Lineage(
                    input_uuids=tuple(str(u) for u in lineage.get("input_uuids", ())),
                    code_version=str(lineage.get("code_version", "")),
                    parameters={str(k): str(v) for k, v in (lineage.get("parameters") or {}).items()},
                    creator=str(lineage.get("creator", "")),
                    start_time=_time_from_json(lineage.get("start_time")),
                    stop_time=_time_from_json(lineage.get("stop_time")),
                ),
                content_hash=str(doc["content_hash"]),
                committed=bool(doc["committed"]),
                create_time=_time_from_json(doc["create_time"]) or _now(),
                commit_time=_time_from_json(doc.get("commit_time")),
                remote_url=doc.get("remote_url") or None,
                localized=bool(doc.get("localized", False)),
                idempotency_key=_idempotency_key_from_json(doc.get("idempotency_key")),
            )
        except (KeyError, TypeError, AttributeError, OverflowError) as exc:  # a float value of 400 digits
            raise ValueError(f"malformed manifest: {exc!r}") from exc

    @classmethod
    def from_json(cls, data: bytes | str, *, context: str | None = None) -> Bundle:
        """Parse :meth:`to_json` output. Raises ValueError when it is not a valid manifest."""
        try:
            doc = json.loads(data)
        except json.JSONDecodeError as exc:
            raise ValueError(f"manifest is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise ValueError("manifest is not a JSON object")
        return cls.from_manifest(doc, context=context)

    def with_state(self, **changes: Any) -> Bundle:
        """A copy with local state (committed, commit_time, remote_url, localized, context) changed."""
        return replace(self, **changes)

    @property
    def request_digest(self) -> str:
        """:func:`compute_request_digest` of the add that made this bundle."""
        return compute_request_digest(self.name, self.tags, self.files, self.values, self.lineage)


@dataclass(frozen=True)
class ContextInfo:
    """A context: a named set of bundles, local to the store, optionally bound to an S3 remote."""

    name: str
    remote_url: str | None
    bundle_count: int


@dataclass(frozen=True)
class TransferProgress:
    """Progress of a push or pull: blobs (files) and bytes confirmed on the other side."""

    files_done: int
    files_total: int
    bytes_done: int
    bytes_total: int


@dataclass(frozen=True)
class RejectedManifest:
    """A remote manifest a pull refused and skipped (the rest of the pull went on).

    ``reason`` is one of :data:`REJECT_REASONS` (a metric label); ``message`` says what is wrong.
    """

    remote_url: str
    key: str
    reason: str
    message: str


REJECT_REASONS = ("key", "signature", "unreadable", "invalid", "mismatch", "content_hash")
"""Why a remote manifest is refused: its key names no canonical UUID and valid bundle name; it has
no signature, or one that none of the store's keys made for it under its key's name and uuid; it
is not a manifest (JSON, format, fields); its uuid, name, paths, hashes, sizes or int values break
the rules (a size or an int out of the int64 the API carries); it
describes another bundle than its key names; its content_hash does not match its files and values."""


@dataclass(frozen=True)
class GcReport:
    blobs_removed: int
    bytes_freed: int
    blobs_kept: int


@dataclass(frozen=True)
class LineageGraph:
    """Bundles reached from one bundle, and edges ``(input_uuid, output_uuid)``.

    An edge may name an input that is not in ``bundles`` when that input is not in the context.
    """

    bundles: tuple[Bundle, ...]
    edges: tuple[tuple[str, str], ...]


# ----------------------------------------------------------------------------------------------
# Content hash and value encoding


def compute_content_hash(files: tuple[FileEntry, ...] | list[FileEntry], values: Mapping[str, Value]) -> str:
    """sha256 over the sorted (path, sha256) pairs of the files and the sorted typed values.

    The encoding is canonical JSON, so ``1``, ``1.0``, ``True`` and ``"1"`` hash differently.
    """
    doc = {
        "files": sorted([entry.path, entry.sha256] for entry in files),
        "values": sorted([key, *next(iter(_encode_value(value).items()))] for key, value in values.items()),
    }
    canonical = json.dumps(doc, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def compute_request_digest(name: str, tags: Mapping[str, str], files: tuple[FileEntry, ...] | list[FileEntry],
                           values: Mapping[str, Value], lineage: Lineage) -> str:
    """sha256 of what an add asked for: the name, tags, files (path, sha256, size, media type), typed
    values and lineage, but for its creator (who asked, not what). Two adds of one idempotency key are
    the same request when these are equal: the retry gets the first's bundle, any other is refused."""
    doc = {
        "name": name,
        "tags": sorted(tags.items()),
        "files": sorted([f.path, f.sha256, f.size, f.media_type] for f in files),
        "values": sorted([key, *next(iter(_encode_value(value).items()))] for key, value in values.items()),
        "lineage": [list(lineage.input_uuids), lineage.code_version, sorted(lineage.parameters.items()),
                    _time_to_json(lineage.start_time), _time_to_json(lineage.stop_time)],
    }
    canonical = json.dumps(doc, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _encode_value(value: Value) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, float):
        return {"float": value if math.isfinite(value) else repr(value)}
    if isinstance(value, str):
        return {"str": value}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"bytes": base64.b64encode(bytes(value)).decode("ascii")}
    raise TypeError(f"unsupported value type {type(value).__name__}")


def _decode_value(doc: Any) -> Value:
    if not isinstance(doc, dict) or len(doc) != 1:
        raise ValueError(f"malformed typed value {doc!r}")
    (kind, raw), = doc.items()
    if kind == "bool":
        return bool(raw)
    if kind == "int":
        return _int_from_json(raw, "an int value")
    if kind == "float":
        return float(raw)
    if kind == "str":
        return str(raw)
    if kind == "bytes":
        return base64.b64decode(raw)
    raise ValueError(f"unknown value type {kind!r}")


IDEMPOTENCY_KEY_MAX = 128


def is_idempotency_key(value: Any) -> bool:
    """At most 128 printable ASCII characters (empty: none)."""
    return isinstance(value, str) and len(value) <= IDEMPOTENCY_KEY_MAX and all(" " <= c <= "~" for c in value)


def _idempotency_key_from_json(raw: Any) -> str:
    if raw is None:
        return ""
    if not is_idempotency_key(raw):
        raise ValueError(f"malformed manifest: idempotency_key {shown(raw)} is not at most "
                         f"{IDEMPOTENCY_KEY_MAX} printable ASCII characters")
    return raw


def _int_from_json(raw: Any, what: str) -> int:
    """An integer a manifest holds, as written (a number with a fraction or an exponent, 1e20 or
    Infinity, is no integer, not even rounded). Its range is the reader's to check."""
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ValueError(f"{what} must be an integer, but got {shown(raw)}")
    return raw


def _time_to_json(value: datetime | None) -> str | None:
    return None if value is None else value.astimezone(UTC).isoformat()


def _time_from_json(value: Any) -> datetime | None:
    if value in (None, ""):
        return None
    return as_utc(datetime.fromisoformat(str(value)), "time")


def _now() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime, field_name: str) -> datetime:
    """``value`` as an aware UTC datetime (a naive one is taken to be UTC)."""
    if not isinstance(value, datetime):
        raise InvalidArgument(field_name, f"`{field_name}` must be a datetime, but got {value!r}.")
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


def label(bundle: Bundle) -> str:
    """How messages name a bundle: its name and uuid."""
    return f"{bundle.name!r} ({bundle.uuid})"


def age(bundle: Bundle) -> tuple[datetime, str]:
    """Sort key of bundle versions, oldest first (the uuid breaks ties)."""
    return (bundle.create_time, bundle.uuid)


def latest_version(versions: list[Bundle]) -> Bundle:
    """The version a bundle name stands for: the newest committed one, else the newest."""
    committed = [bundle for bundle in versions if bundle.committed]
    return max(committed or versions, key=age)


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for an error message that shows a caller's input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
