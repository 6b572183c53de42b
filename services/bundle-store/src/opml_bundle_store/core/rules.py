"""The rules every input to the store follows, checked before it becomes a bundle, a context or a value.

The helpers raise :class:`~opml_common.errors.InvalidArgument` with the field named, the value shown
and the rule stated, so the gRPC layer can pass the message to the caller as is. A bundle's file paths
follow the contract's rules (:mod:`opml_bundle_store_contract.paths`), which clients apply too.
"""

from __future__ import annotations

import re
import uuid as uuid_mod
from collections.abc import Mapping
from typing import Any

from opml_bundle_store.core.manifest import IDEMPOTENCY_KEY_MAX, Lineage, as_utc, is_idempotency_key, shown
from opml_bundle_store_contract.values import Value
from opml_common.errors import InvalidArgument

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_KEY_LENGTH = 256
MAX_LINEAGE_INPUTS = 10_000  # ~400 KB of UUIDs in the manifest and in each event carrying the bundle (1 MiB at most)

_CONTEXT_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
_BUNDLE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MEDIA_TYPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}(;.*)?")


def check_int(field: str, value: Any, low: int, high: int, note: str = "") -> None:
    """Raises InvalidArgument unless ``value`` is an int (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidArgument(
            field, f"`{field}` must be an integer in [{low}, {high}]{' ' + note if note else ''}, but got {value!r}."
        )


def validate_context_id(value: Any, field: str = "context_id") -> str:
    """Raise InvalidArgument unless ``value`` is a context id: ``[a-z0-9][a-z0-9-]{0,62}``."""
    if not isinstance(value, str) or not _CONTEXT_ID.fullmatch(value):
        raise InvalidArgument(
            field,
            f"`{field}` must match [a-z0-9][a-z0-9-]{{0,62}} (lowercase letters, digits and '-', "
            f"1-63 characters, starting with a letter or digit), but got {shown(value)}.",
        )
    return value


def validate_bundle_name(value: Any, field: str = "bundle_name") -> str:
    """Raise InvalidArgument unless ``value`` is a bundle name: ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``."""
    if not isinstance(value, str) or not _BUNDLE_NAME.fullmatch(value):
        raise InvalidArgument(
            field,
            f"`{field}` must match [A-Za-z0-9][A-Za-z0-9._-]{{0,127}} (letters, digits, '.', '_' and '-', "
            f"1-128 characters, starting with a letter or digit), but got {shown(value)}.",
        )
    return value


def validate_uuid(value: Any, field: str = "uuid") -> str:
    """Raise InvalidArgument unless ``value`` is a UUID; return its canonical lowercase form."""
    if isinstance(value, str):
        try:
            return str(uuid_mod.UUID(value))
        except ValueError:
            pass
    raise InvalidArgument(
        field, f"`{field}` must be a UUID like '0b9e6f3c-5a4d-4c1e-9f7a-2d8b1c3e4f5a', but got {shown(value)}."
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
        raise InvalidArgument(field, f"`{field}` must be 64 hex digits (a sha256), but got {shown(value)}.")
    return value.lower()


def validate_media_type(value: Any, field: str = "media_type") -> str:
    """Raise InvalidArgument unless ``value`` looks like ``type/subtype``."""
    if not isinstance(value, str) or not _MEDIA_TYPE.fullmatch(value):
        raise InvalidArgument(
            field, f"`{field}` must be a media type like 'application/onnx', but got {shown(value)}."
        )
    return value


def validate_idempotency_key(value: Any, field: str = "idempotency_key") -> str:
    """An add's idempotency key: '' (none), or at most 128 printable ASCII characters."""
    if value is None:
        return ""
    if not is_idempotency_key(value):
        raise InvalidArgument(field, f"`{field}` must be at most {IDEMPOTENCY_KEY_MAX} printable ASCII characters, "
                                     f"but got {shown(value)}.")
    return value


def validate_string_map(value: Any, field: str, *, max_value_length: int | None = None) -> dict[str, str]:
    """A dict of non-empty string keys (at most 256 characters) to string values."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidArgument(field, f"`{field}` must be a mapping of strings to strings, but got {shown(value)}.")
    result: dict[str, str] = {}
    for key, item in value.items():
        _validate_key(key, field)
        if not isinstance(item, str):
            raise InvalidArgument(
                f"{field}[{key}]", f"`{field}[{key}]` must be a string, but got {shown(item)}."
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
            f"but got the key {shown(key)}.",
        )


def validate_values(value: Any, field: str = "values") -> dict[str, Value]:
    """A dict of typed scalar values: int (int64), float, str, bool or bytes."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidArgument(field, f"`{field}` must be a mapping of names to values, but got {shown(value)}.")
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
                f"{shown(item)}."
            )
    return result


def validate_lineage(value: Any, field: str = "lineage") -> Lineage:
    """A Lineage with at most ``MAX_LINEAGE_INPUTS`` canonical input UUIDs (duplicates dropped, first
    kept), UTC times and ``stop_time >= start_time``."""
    if value is None:
        return Lineage()
    if not isinstance(value, Lineage):
        raise InvalidArgument(field, f"`{field}` must be a Lineage, but got {shown(value)}.")
    if len(value.input_uuids) > MAX_LINEAGE_INPUTS:
        raise InvalidArgument(f"{field}.input_uuids", f"`{field}.input_uuids` must hold at most {MAX_LINEAGE_INPUTS} "
                                                      f"bundles, but got {len(value.input_uuids)}.")
    inputs = dict.fromkeys(validate_uuid(item, f"{field}.input_uuids[{index}]")
                           for index, item in enumerate(value.input_uuids))
    for name in ("code_version", "creator"):
        if not isinstance(getattr(value, name), str):
            raise InvalidArgument(
                f"{field}.{name}", f"`{field}.{name}` must be a string, but got {shown(getattr(value, name))}."
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
