"""Bundles and their parts as immutable values, their JSON manifest, and the input rules.

A bundle (after Intuit's Disdat) is a versioned, immutable, typed collection of files and scalar
values with lineage. Every version of a bundle shares its ``name`` and has its own ``uuid``.
Files live in content-addressed blobs named by their sha256; the manifest (this module's JSON)
lists them. ``content_hash`` identifies the content: equal files (path, sha256) and equal typed
values give an equal hash, whatever the tags, lineage or times.

The validation helpers raise :class:`~opml_common.errors.InvalidArgument` with the field named,
the value shown and the rule stated, so the gRPC layer can pass the message to the caller as is.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import unicodedata
import uuid as uuid_mod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from opml_common.errors import InvalidArgument

Value = int | float | str | bool | bytes

MANIFEST_FORMAT = 1
DEFAULT_MEDIA_TYPE = "application/octet-stream"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_PATH_LENGTH = 1024
MAX_SEGMENT_BYTES = 255
MAX_KEY_LENGTH = 256
MAX_LINEAGE_INPUTS = 10_000  # ~400 KB of UUIDs in the manifest and in each event carrying the bundle (1 MiB at most)

_CONTEXT_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
_BUNDLE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_MEDIA_TYPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}(;.*)?")
_EMPTY: Mapping[str, Any] = MappingProxyType({})
#: C0 controls (newlines and NUL included), DEL and C1 controls: never part of a bundle path.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


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


REJECT_REASONS = ("key", "unreadable", "invalid", "mismatch", "content_hash")
"""Why a remote manifest is refused: its key names no canonical UUID and valid bundle name; it
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


def _int_from_json(raw: Any, what: str) -> int:
    """An integer a manifest holds, as written (a number with a fraction or an exponent, 1e20 or
    Infinity, is no integer, not even rounded). Its range is the reader's to check."""
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ValueError(f"{what} must be an integer, but got {_short(raw)}")
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


# ----------------------------------------------------------------------------------------------
# Validation


def check_int(field: str, value: Any, low: int, high: int, note: str = "") -> None:
    """Raises InvalidArgument unless ``value`` is an int (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidArgument(
            field, f"`{field}` must be an integer in [{low}, {high}]{' ' + note if note else ''}, but got {value!r}."
        )


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validate_context_id(value: Any, field: str = "context_id") -> str:
    """Raise InvalidArgument unless ``value`` is a context id: ``[a-z0-9][a-z0-9-]{0,62}``."""
    if not isinstance(value, str) or not _CONTEXT_ID.fullmatch(value):
        raise InvalidArgument(
            field,
            f"`{field}` must match [a-z0-9][a-z0-9-]{{0,62}} (lowercase letters, digits and '-', "
            f"1-63 characters, starting with a letter or digit), but got {_short(value)}.",
        )
    return value


def validate_bundle_name(value: Any, field: str = "bundle_name") -> str:
    """Raise InvalidArgument unless ``value`` is a bundle name: ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``."""
    if not isinstance(value, str) or not _BUNDLE_NAME.fullmatch(value):
        raise InvalidArgument(
            field,
            f"`{field}` must match [A-Za-z0-9][A-Za-z0-9._-]{{0,127}} (letters, digits, '.', '_' and '-', "
            f"1-128 characters, starting with a letter or digit), but got {_short(value)}.",
        )
    return value


def validate_bundle_path(value: Any, field: str = "path") -> str:
    """Raise InvalidArgument unless ``value`` is a file path inside a bundle.

    Rules: a non-empty string of at most 1024 characters, '/'-separated and relative (no leading
    '/'), with no empty, '.' or '..' segment, no segment over 255 bytes (UTF-8: the limit of
    ext4, APFS and NTFS), no backslash (a separator on Windows) and no control character (NUL,
    newlines and the rest of C0 and C1). Paths that only collide with others (case, Unicode
    normalisation, a file and a directory of one name) are :func:`validate_bundle_paths`' part.
    """
    rule = ("must be a relative '/'-separated path with no empty, '.' or '..' segments "
            f"(at most {MAX_PATH_LENGTH} characters)")
    if not isinstance(value, str) or not value:
        raise InvalidArgument(field, f"`{field}` {rule}, but got {_short(value)}.")
    if len(value) > MAX_PATH_LENGTH:
        raise InvalidArgument(field, f"`{field}` {rule}, but got {len(value)} characters: {_short(value)}.")
    control = _CONTROL.search(value)
    if control:
        raise InvalidArgument(
            field, f"`{field}` must not contain control characters (NUL, newlines, ...), but got "
                   f"{control.group()!r} in {_short(value)}.")
    if "\\" in value:
        raise InvalidArgument(
            field, f"`{field}` must use '/' as its only separator (no backslash), but got {_short(value)}.")
    if value.startswith("/"):
        raise InvalidArgument(field, f"`{field}` {rule}, but got the absolute path {_short(value)}.")
    for segment in value.split("/"):
        if segment in ("", ".", ".."):
            raise InvalidArgument(
                field, f"`{field}` {rule}, but got {_short(value)} with the segment {segment!r}."
            )
        size = len(segment.encode("utf-8", "surrogatepass"))
        if size > MAX_SEGMENT_BYTES:
            raise InvalidArgument(
                field, f"`{field}` segments must be at most {MAX_SEGMENT_BYTES} bytes (UTF-8), but "
                       f"{_short(value)} has a segment of {size} bytes.")
    return value


def path_key(path: str) -> str:
    """The form in which two bundle paths collide on some file system: Unicode NFC, case folded
    (macOS and Windows fold case; macOS normalises names)."""
    return unicodedata.normalize("NFC", unicodedata.normalize("NFC", path).casefold())


class PathSet:
    """Bundle paths added so far, indexed so that each new one is checked for collisions in
    O(depth): same file after NFC and case folding, or a file and a directory of one name."""

    def __init__(self) -> None:
        self._files: dict[str, str] = {}  # path key -> the path
        self._directories: dict[str, str] = {}  # key of each directory some path lies in -> that path

    def collision(self, path: str) -> tuple[str, str] | None:
        """``(problem, other path)`` when ``path`` (a valid bundle path) collides with one added."""
        key = path_key(path)
        if (other := self._files.get(key)) is not None:
            if other == path:
                return "repeats", other
            return f"(code points {ascii(path)}) differs only in case or Unicode normalisation from", other
        if (other := self._directories.get(key)) is not None:
            return "is a file, but is a directory in", other
        segments = key.split("/")
        for end in range(1, len(segments)):
            if (other := self._files.get("/".join(segments[:end]))) is not None:
                return "needs a directory where there is a file in", other
        return None

    def add(self, path: str) -> None:
        key = path_key(path)
        self._files[key] = path
        segments = key.split("/")
        for end in range(1, len(segments)):
            self._directories.setdefault("/".join(segments[:end]), path)


COLLISION_RULE = "paths in a bundle must not collide on any file system (case, Unicode form, a file and a " \
                 "directory of one name)"


def path_violations(paths: list[str], field: str = "files") -> list[tuple[str, str]]:
    """Every rule the bundle paths ``paths`` break, as ``(f"{field}[i].path", rule)`` pairs.

    Each path must pass :func:`validate_bundle_path`, and no two may land on the same file
    anywhere (:class:`PathSet`).
    """
    violations: list[tuple[str, str]] = []
    seen = PathSet()
    index_of: dict[str, int] = {}
    for index, path in enumerate(paths):
        name = f"{field}[{index}].path"
        try:
            validate_bundle_path(path, name)
        except InvalidArgument as exc:
            violations.extend(exc.violations)
            continue
        found = seen.collision(path)
        if found is not None:
            problem, other = found
            violations.append((name, f"`{name}` {_short(path)} {problem} `{field}[{index_of[other]}].path` "
                                     f"{_short(other)}: {COLLISION_RULE}"))
            continue
        seen.add(path)
        index_of.setdefault(path, index)
    return violations


def validate_bundle_paths(paths: list[str], field: str = "files") -> None:
    """Raise InvalidArgument naming every ``{field}[i].path`` that breaks :func:`path_violations`' rules."""
    violations = path_violations(paths, field)
    if violations:
        raise InvalidArgument.of(violations)


def validate_uuid(value: Any, field: str = "uuid") -> str:
    """Raise InvalidArgument unless ``value`` is a UUID; return its canonical lowercase form."""
    if isinstance(value, str):
        try:
            return str(uuid_mod.UUID(value))
        except ValueError:
            pass
    raise InvalidArgument(
        field, f"`{field}` must be a UUID like '0b9e6f3c-5a4d-4c1e-9f7a-2d8b1c3e4f5a', but got {_short(value)}."
    )


def is_uuid(value: str) -> bool:
    """True when ``value`` is a UUID in canonical lowercase form."""
    try:
        return str(uuid_mod.UUID(value)) == value
    except (ValueError, TypeError, AttributeError):
        return False


def validate_sha256(value: Any, field: str = "sha256") -> str:
    """Raise InvalidArgument unless ``value`` is a lowercase hex sha256 (64 characters)."""
    if not isinstance(value, str) or not _SHA256.fullmatch(value.lower()):
        raise InvalidArgument(field, f"`{field}` must be 64 hex digits (a sha256), but got {_short(value)}.")
    return value.lower()


def validate_media_type(value: Any, field: str = "media_type") -> str:
    """Raise InvalidArgument unless ``value`` looks like ``type/subtype``."""
    if not isinstance(value, str) or not _MEDIA_TYPE.fullmatch(value):
        raise InvalidArgument(
            field, f"`{field}` must be a media type like 'application/onnx', but got {_short(value)}."
        )
    return value


def parse_remote_url(value: Any, field: str = "remote_url") -> tuple[str, str]:
    """Split ``s3://bucket/prefix`` into ``(bucket, prefix)``; prefix has no leading or trailing '/'.

    Rules: scheme ``s3``; the bucket is an S3 bucket name (3-63 characters: lowercase letters,
    digits, '.', '-', starting and ending with a letter or digit, no '..'); the optional prefix is
    '/'-separated with no empty (other than one trailing '/'), '.' or '..' segments.
    """
    example = "s3://my-bucket/some/prefix"
    if not isinstance(value, str) or not value.startswith("s3://"):
        raise InvalidArgument(field, f"`{field}` must look like {example!r}, but got {_short(value)}.")
    bucket, _, prefix = value[len("s3://"):].partition("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket or re.fullmatch(r"[0-9.]+", bucket):
        raise InvalidArgument(
            field,
            f"`{field}` must name an S3 bucket of 3-63 lowercase letters, digits, '.' or '-' "
            f"(like {example!r}), but got the bucket {bucket!r} in {_short(value)}.",
        )
    prefix = prefix.removesuffix("/")
    if prefix:
        for segment in prefix.split("/"):
            if segment in ("", ".", "..") or "\x00" in segment:
                raise InvalidArgument(
                    field,
                    f"`{field}` prefix must be '/'-separated with no empty, '.' or '..' segments, "
                    f"but got {_short(value)}.",
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


def validate_string_map(value: Any, field: str, *, max_value_length: int | None = None) -> dict[str, str]:
    """A dict of non-empty string keys (at most 256 characters) to string values."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidArgument(field, f"`{field}` must be a mapping of strings to strings, but got {_short(value)}.")
    result: dict[str, str] = {}
    for key, item in value.items():
        _validate_key(key, field)
        if not isinstance(item, str):
            raise InvalidArgument(
                f"{field}[{key}]", f"`{field}[{key}]` must be a string, but got {_short(item)}."
            )
        if max_value_length is not None and len(item) > max_value_length:
            raise InvalidArgument(
                f"{field}[{key}]",
                f"`{field}[{key}]` must be at most {max_value_length} characters, but got {len(item)}.",
            )
        result[key] = item
    return result


def _validate_key(key: Any, field: str) -> None:
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH or "\x00" in key:
        raise InvalidArgument(
            field,
            f"`{field}` keys must be non-empty strings of at most {MAX_KEY_LENGTH} characters, "
            f"but got the key {_short(key)}.",
        )


def validate_values(value: Any, field: str = "values") -> dict[str, Value]:
    """A dict of typed scalar values: int (int64), float, str, bool or bytes."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidArgument(field, f"`{field}` must be a mapping of names to values, but got {_short(value)}.")
    result: dict[str, Value] = {}
    for key, item in value.items():
        _validate_key(key, field)
        name = f"{field}[{key}]"
        if isinstance(item, bool):
            result[key] = item
        elif isinstance(item, int):
            if not INT64_MIN <= item <= INT64_MAX:
                raise InvalidArgument(name, f"`{name}` must fit in a signed 64-bit integer, but got {item}.")
            result[key] = int(item)
        elif isinstance(item, float):
            result[key] = float(item)
        elif isinstance(item, str):
            result[key] = item
        elif isinstance(item, (bytes, bytearray, memoryview)):
            result[key] = bytes(item)
        else:
            raise InvalidArgument(
                name, f"`{name}` must be an int, float, str, bool or bytes, but got {type(item).__name__} "
                f"{_short(item)}."
            )
    return result


def validate_lineage(value: Any, field: str = "lineage") -> Lineage:
    """A Lineage with at most ``MAX_LINEAGE_INPUTS`` canonical input UUIDs (duplicates dropped, first
    kept), UTC times and ``stop_time >= start_time``."""
    if value is None:
        return Lineage()
    if not isinstance(value, Lineage):
        raise InvalidArgument(field, f"`{field}` must be a Lineage, but got {_short(value)}.")
    if len(value.input_uuids) > MAX_LINEAGE_INPUTS:
        raise InvalidArgument(f"{field}.input_uuids", f"`{field}.input_uuids` must hold at most {MAX_LINEAGE_INPUTS} "
                                                      f"bundles, but got {len(value.input_uuids)}.")
    inputs = dict.fromkeys(validate_uuid(item, f"{field}.input_uuids[{index}]")
                           for index, item in enumerate(value.input_uuids))
    for name in ("code_version", "creator"):
        if not isinstance(getattr(value, name), str):
            raise InvalidArgument(
                f"{field}.{name}", f"`{field}.{name}` must be a string, but got {_short(getattr(value, name))}."
            )
    start = None if value.start_time is None else as_utc(value.start_time, f"{field}.start_time")
    stop = None if value.stop_time is None else as_utc(value.stop_time, f"{field}.stop_time")
    if start is not None and stop is not None and stop < start:
        raise InvalidArgument(
            f"{field}.stop_time",
            f"`{field}.stop_time` must not be before `{field}.start_time` ({start.isoformat()}), "
            f"but got {stop.isoformat()}.",
        )
    return Lineage(
        input_uuids=tuple(inputs),
        code_version=value.code_version,
        parameters=validate_string_map(value.parameters, f"{field}.parameters"),
        creator=value.creator,
        start_time=start,
        stop_time=stop,
    )
