"""Read and amend the routing header of KServe v2 messages without decoding their tensors.

The router forwards ``ModelInferRequest`` / ``ModelInferResponse`` as the bytes that arrived, so
routing costs the same for a 100-byte and a 10-MB request. It needs three string fields of the
request (``model_name`` = 1, ``model_version`` = 2, ``id`` = 3; the same numbers in the response).
:func:`read_header` walks the top-level fields of the protobuf wire format and skips the others by
their length (O(1) each, whatever their size), and visits at most :data:`MAX_FIELDS` fields, so
the walk's work is bounded whatever the message holds (62 MiB of two-byte unknown fields would
otherwise be 30 million steps); :func:`with_field` appends a string field: protobuf parsers keep the last value of a
non-repeated field, so appending overrides a value the message already had (the encoding spec's
"last one wins"), with no copy of the tensors beyond the one ``bytes`` concatenation.
:func:`string_parameter` reads one string request parameter (``parameters`` = 4) the same way: the
client's site (:data:`SITE_PARAMETER`).
"""

from __future__ import annotations

from typing import NamedTuple

MODEL_NAME = 1
MODEL_VERSION = 2
REQUEST_ID = 3
PARAMETERS = 4

SITE_PARAMETER = "site"
"""The request parameter that names the client's site: the router sends the request to that site's
replicas first (:meth:`~.replicas.ReplicaSet.pick`). A string, e.g. ``parameters={"site": "edge-a"}``
with tritonclient."""

MAX_FIELDS = 4096
"""Most top-level fields :func:`read_header` visits. A ModelInferRequest has one per input, output,
raw tensor and parameter plus three: a real one has tens."""


class MalformedMessage(ValueError):
    """The bytes are not a protobuf message (truncated field, bad wire type), or one the router
    will not walk (more than ``max_fields`` top-level fields)."""


class Header(NamedTuple):
    model_name: str
    model_version: str
    request_id: str


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise MalformedMessage("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise MalformedMessage("varint longer than 10 bytes")


def _skip(data: bytes, pos: int, number: int, wire_type: int) -> int:
    """Where a field that is not length-delimited ends (its value starts at ``pos``)."""
    if wire_type == 0:
        return _varint(data, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 5:
        return pos + 4
    raise MalformedMessage(f"unsupported wire type {wire_type} for field {number}")


def read_header(data: bytes, *, max_fields: int = MAX_FIELDS) -> Header:
    """The model name, version and request id of a serialized ModelInferRequest (or Response).

    Raises:
        MalformedMessage: the bytes are not a well-formed protobuf message, or hold more than
            ``max_fields`` top-level fields.
    """
    fields = ["", "", ""]
    pos, end = 0, len(data)
    left = max_fields
    while pos < end:
        if not left:
            raise MalformedMessage(f"it holds more than {max_fields} top-level fields, the most the router reads "
                                   f"(stopped at byte {pos} of {end})")
        left -= 1
        key = data[pos]  # one-byte keys and lengths inline: the common case, without a call
        if key < 0x80:
            pos += 1
        else:
            key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 2:
            length = data[pos] if pos < end else 0x80
            if length < 0x80:
                pos += 1
            else:
                length, pos = _varint(data, pos)
            if pos + length > end:
                raise MalformedMessage(f"field {number} runs past the end of the message")
            if 1 <= number <= 3:
                try:
                    fields[number - 1] = data[pos:pos + length].decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise MalformedMessage(f"field {number} is not a UTF-8 string") from exc
            pos += length
        else:
            pos = _skip(data, pos, number, wire_type)
    if pos != end:
        raise MalformedMessage("the last field runs past the end of the message")
    return Header(*fields)


def _fields(data: bytes, max_fields: int) -> list[tuple[int, int, int, int]]:
    """``(number, wire_type, start, end)`` of each top-level field (for length-delimited ones, start and
    end of its bytes), at most ``max_fields`` of them. Raises: MalformedMessage."""
    found = []
    pos, end = 0, len(data)
    while pos < end:
        if len(found) >= max_fields:
            raise MalformedMessage(f"it holds more than {max_fields} top-level fields, the most the router reads")
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        start = pos
        if wire_type == 2:
            length, start = _varint(data, pos)
            pos = start + length
        else:
            pos = _skip(data, pos, number, wire_type)
        if pos > end:
            raise MalformedMessage(f"field {number} runs past the end of the message")
        found.append((number, wire_type, start, pos))
    return found


def string_parameter(data: bytes, name: str, *, max_length: int, max_fields: int = MAX_FIELDS) -> str:
    """The string parameter ``name`` of a serialized ModelInferRequest (the last one given, as a parser
    keeps); '' when it has none, when it is another type or not UTF-8, or when it is longer than
    ``max_length`` characters (the router only ranks by it: a bad one is ignored, never an error).
    The walk skips every other field by its length, as :func:`read_header` does.

    Raises:
        MalformedMessage: the bytes are not a well-formed protobuf message.
    """
    wanted = name.encode("utf-8")
    value = ""
    for number, wire_type, start, end in _fields(data, max_fields):
        if number != PARAMETERS or wire_type != 2:
            continue
        entry = data[start:end]  # a map entry: key = 1, value = 2 (an InferParameter)
        key, parameter = None, None
        for field, kind, begin, finish in _fields(entry, 8):
            if field == 1 and kind == 2:
                key = entry[begin:finish]
            elif field == 2 and kind == 2:
                parameter = entry[begin:finish]
        if key != wanted:
            continue
        value = ""
        for field, kind, begin, finish in _fields(parameter or b"", 8):
            if field == 3 and kind == 2 and finish - begin <= 4 * max_length:  # string_param
                try:
                    text = parameter[begin:finish].decode("utf-8")  # type: ignore[index]
                except UnicodeDecodeError:
                    continue
                value = text if len(text) <= max_length else ""
    return value


def version_leads(data: bytes) -> bool:
    """Whether ``data`` (a ModelInferResponse) starts with a non-empty model_version, after an optional
    model_name: where every protobuf serializer writes it. O(1); a False for a message that has it
    elsewhere only costs a redundant (and harmless) :func:`with_field`."""
    pos = 0
    if data[:1] == b"\x0a":  # model_name (field 1, length-delimited)
        if len(data) < 2 or data[1] >= 0x80:
            return False
        pos = 2 + data[1]
    return data[pos:pos + 1] == b"\x12" and data[pos + 1:pos + 2] not in (b"", b"\x00")


def encode_field(number: int, value: str) -> bytes:
    """One length-delimited string field in wire format (append it to override the field)."""
    raw = value.encode("utf-8")
    return _encode_varint((number << 3) | 2) + _encode_varint(len(raw)) + raw


def with_field(data: bytes, number: int, value: str) -> bytes:
    """``data`` with string field ``number`` set to ``value`` (appended: the last value wins)."""
    return data + encode_field(number, value)


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
