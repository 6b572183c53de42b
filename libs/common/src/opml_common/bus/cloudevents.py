"""CloudEvents 1.0 in the Kafka protocol binding, binary content mode.

An event's attributes travel as Kafka record headers (``ce_specversion``, ``ce_id``, ``ce_source``,
``ce_type``, ``ce_time``, ``ce_subject``, ``ce_dataschema``, ``ce_<extension>``; the data content
type as ``content-type``), and the record value is the data itself: the serialized protobuf
message from protos/. ``ce_type`` is the message's full name (``opml.bundles.v1.BundleCommitted``),
so a consumer knows which message class parses the bytes.

Spec: https://github.com/cloudevents/spec/blob/v1.0.2/cloudevents/bindings/kafka-protocol-binding.md
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TypeVar

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

SPEC_VERSION = "1.0"
PROTOBUF_CONTENT_TYPE = "application/protobuf"
JSON_CONTENT_TYPE = "application/json"
# Content types whose data ``parse`` reads as the protobuf binary encoding.
_PROTOBUF_TYPES = frozenset({"application/protobuf", "application/x-protobuf", "application/vnd.google.protobuf"})

# Attributes of the spec itself: an extension may not reuse these names.
_CONTEXT_ATTRIBUTES = frozenset(
    {"specversion", "id", "source", "type", "time", "subject", "dataschema", "datacontenttype", "data"}
)
_EXTENSION_NAME = re.compile(r"^[a-z0-9]{1,20}$")
_HEADER_PREFIX = "ce_"

M = TypeVar("M", bound=Message)


class MalformedEvent(Exception):
    """A record is not a valid CloudEvent, or its data is not the message its type names.

    Never retriable: the same bytes fail the same way on every attempt, so consumers send the
    record to the dead-letter topic at once. The message says which attribute or what is wrong.
    """

    retriable = False


class _Extensions(Mapping[str, str]):
    """A read-only copy of the extension attributes (picklable, unlike ``MappingProxyType``)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, str] | None = None) -> None:
        self._items = dict(items or {})

    def __getitem__(self, key: str) -> str:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return repr(self._items)

    def __reduce__(self) -> tuple:
        return (_Extensions, (self._items,))


def _format_time(value: datetime) -> str:
    """RFC 3339 in UTC with microseconds and a ``Z``: ``2024-05-01T12:00:00.123456Z``."""
    return value.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _parse_time(text: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(text.strip())
    except ValueError as exc:
        raise MalformedEvent(f"ce_time must be an RFC 3339 timestamp, but got {text!r}") from exc
    if parsed.tzinfo is None:
        raise MalformedEvent(f"ce_time must carry a UTC offset or 'Z' (RFC 3339), but got {text!r}")
    return parsed


@dataclass(frozen=True)
class CloudEvent:
    """One CloudEvents 1.0 event whose data is (usually) a serialized protobuf message.

    Build one with :meth:`from_proto`; write it with :meth:`kafka_headers` plus ``data`` as the
    record value; read one with :meth:`from_kafka` and :meth:`parse`.

    Raises:
        ValueError: from the constructor when ``id``, ``source`` or ``type`` is empty, ``time`` is
            naive, or an extension name is not 1-20 lowercase letters/digits or reuses a spec name.
        TypeError: ``data`` is not bytes or an extension value is not a string.
    """

    id: str
    source: str
    type: str
    time: datetime
    data: bytes
    subject: str | None = None
    datacontenttype: str = PROTOBUF_CONTENT_TYPE
    dataschema: str | None = None
    extensions: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("id", "source", "type"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"CloudEvent `{name}` must be a non-empty string, but got {value!r}")
        if self.time.tzinfo is None:
            raise ValueError(f"CloudEvent `time` must be timezone-aware (use UTC), but got {self.time!r}")
        if not isinstance(self.data, bytes):
            raise TypeError(f"CloudEvent `data` must be bytes, but got {type(self.data).__name__}")
        for name, value in self.extensions.items():
            if not _EXTENSION_NAME.match(name) or name in _CONTEXT_ATTRIBUTES:
                raise ValueError(
                    f"CloudEvent extension names must be 1-20 lowercase letters or digits and not a spec "
                    f"attribute name, but got {name!r}"
                )
            if not isinstance(value, str):
                raise TypeError(f"CloudEvent extension {name!r} must be a string, but got {type(value).__name__}")
        # Frozen all the way down: a caller's dict changed later must not change the event.
        object.__setattr__(self, "extensions", _Extensions(self.extensions))

    @classmethod
    def from_proto(
        cls,
        message: Message,
        *,
        source: str,
        subject: str | None = None,
        id: str | None = None,
        extensions: Mapping[str, str] | None = None,
    ) -> CloudEvent:
        """An event carrying ``message``: type and dataschema from its full name, a new uuid4 id, time now."""
        full_name = message.DESCRIPTOR.full_name
        return cls(
            id=id or str(uuid.uuid4()),
            source=source,
            type=full_name,
            time=datetime.now(UTC),
            data=message.SerializeToString(),
            subject=subject,
            datacontenttype=PROTOBUF_CONTENT_TYPE,
            dataschema="proto:" + full_name,
            extensions=dict(extensions or {}),
        )

    def kafka_headers(self) -> list[tuple[str, bytes]]:
        """The record headers of the binary content mode (values UTF-8)."""
        headers = [
            ("ce_specversion", SPEC_VERSION),
            ("ce_id", self.id),
            ("ce_source", self.source),
            ("ce_type", self.type),
            ("ce_time", _format_time(self.time)),
        ]
        if self.subject is not None:
            headers.append(("ce_subject", self.subject))
        if self.dataschema is not None:
            headers.append(("ce_dataschema", self.dataschema))
        headers.append(("content-type", self.datacontenttype))
        headers.extend((_HEADER_PREFIX + name, value) for name, value in sorted(self.extensions.items()))
        return [(name, value.encode("utf-8")) for name, value in headers]

    @classmethod
    def from_kafka(
        cls,
        headers: Iterable[tuple[str, bytes | None]] | None,
        value: bytes | None,
        *,
        timestamp_ms: int | None = None,
    ) -> CloudEvent:
        """Read the event of one Kafka record (its headers and value).

        ``timestamp_ms`` (the record's timestamp) stands in for ``time`` when ``ce_time`` is absent,
        which the spec allows; without either, the record is malformed.

        Raises:
            MalformedEvent: ``ce_specversion`` is not 1.0, ``ce_id``/``ce_source``/``ce_type`` is missing
                or empty, a header is not UTF-8, or ``ce_time`` is not RFC 3339.
        """
        attributes: dict[str, str] = {}
        content_type: str | None = None
        for raw_name, raw_value in headers or ():
            name = raw_name.lower()
            if name != "content-type" and not name.startswith(_HEADER_PREFIX):
                continue  # other headers (tracing, ours) are not event attributes
            try:
                text = (raw_value or b"").decode("utf-8")
            except UnicodeDecodeError as exc:
                raise MalformedEvent(f"header {raw_name!r} must be UTF-8, but got {raw_value!r}") from exc
            if name == "content-type":
                content_type = text
            else:
                attributes[name[len(_HEADER_PREFIX):]] = text

        specversion = attributes.pop("specversion", None)
        if specversion is None:
            raise MalformedEvent("header ce_specversion is missing: the record is not a CloudEvent (binary mode)")
        if specversion != SPEC_VERSION:
            raise MalformedEvent(f"ce_specversion must be {SPEC_VERSION!r}, but got {specversion!r}")
        required = {}
        for name in ("id", "source", "type"):
            found = attributes.pop(name, "")
            if not found:
                raise MalformedEvent(f"header ce_{name} is missing or empty; CloudEvents 1.0 requires it")
            required[name] = found
        time_text = attributes.pop("time", None)
        if time_text is not None:
            time = _parse_time(time_text)
        elif timestamp_ms is not None:
            time = datetime.fromtimestamp(timestamp_ms / 1000, UTC)
        else:
            raise MalformedEvent("header ce_time is missing and no record timestamp was given")
        subject = attributes.pop("subject", None)
        dataschema = attributes.pop("dataschema", None)
        attributes.pop("datacontenttype", None)  # content-type is the binding's header for it
        try:
            return cls(
                id=required["id"],
                source=required["source"],
                type=required["type"],
                time=time,
                data=value or b"",
                subject=subject,
                datacontenttype=content_type or PROTOBUF_CONTENT_TYPE,
                dataschema=dataschema,
                extensions=attributes,
            )
        except (TypeError, ValueError) as exc:
            raise MalformedEvent(str(exc)) from exc

    def parse(self, message_cls: type[M]) -> M:
        """The data as a ``message_cls`` instance.

        Reads the protobuf binary encoding, or protobuf JSON when ``datacontenttype`` is
        application/json.

        Raises:
            MalformedEvent: ``type`` is not ``message_cls``'s full name, the content type is neither
                protobuf nor JSON, or the bytes do not parse.
        """
        expected = message_cls.DESCRIPTOR.full_name
        if self.type != expected:
            raise MalformedEvent(f"event {self.id} has ce_type {self.type!r}, but the handler expects {expected!r}")
        content_type = self.datacontenttype.split(";", 1)[0].strip().lower()
        message = message_cls()
        try:
            if content_type in _PROTOBUF_TYPES:
                message.ParseFromString(self.data)
            elif content_type == JSON_CONTENT_TYPE:
                json_format.Parse(self.data.decode("utf-8"), message)
            else:
                raise MalformedEvent(
                    f"event {self.id} has content-type {self.datacontenttype!r}; "
                    f"expected {PROTOBUF_CONTENT_TYPE!r} or {JSON_CONTENT_TYPE!r}"
                )
        except MalformedEvent:
            raise
        except (DecodeError, json_format.Error, ValueError) as exc:
            raise MalformedEvent(f"event {self.id}: data does not parse as {expected}: {exc}") from exc
        return message

    def __repr__(self) -> str:  # data can be large: show its size, not its bytes
        return (
            f"CloudEvent(id={self.id!r}, source={self.source!r}, type={self.type!r}, "
            f"subject={self.subject!r}, time={_format_time(self.time)}, data=<{len(self.data)} bytes>)"
        )

