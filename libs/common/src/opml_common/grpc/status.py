"""Rich error details on the wire (google.rpc.Status in ``grpc-status-details-bin``), both ways.

INVALID_ARGUMENT carries a ``google.rpc.BadRequest`` with one field violation per broken rule, beside
the human message, so a client in any language reads *which* field was wrong without parsing text.

Both travel as headers, within gRPC's metadata limit (8 KiB before a client may refuse them, and
a client refuses all over 16 KiB with RESOURCE_EXHAUSTED, naming nothing). So what is sent is capped:
the message to ``MESSAGE_BYTES``, keeping an InvalidArgument's first violations whole and counting
the others ("...; and 27 more"), and the details to the violations that fit ``VIOLATION_BYTES``.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from opml_common.errors import InvalidArgument, OpmlError

_DETAILS_KEY = "grpc-status-details-bin"
MESSAGE_BYTES = 512  # UTF-8 bytes of the status message sent (percent-encoded on the wire: up to 3x)
VIOLATION_BYTES = 2048  # UTF-8 bytes of the field paths and rules sent as BadRequest (base64 on the wire)
_FIELD_BYTES, _RULE_BYTES = 256, 512  # of one violation sent
_MORE = "; and {} more"


def wire_message(error: OpmlError) -> str:
    """``error.message`` as sent: cut to ``MESSAGE_BYTES``. An InvalidArgument's keeps as many of its
    first violations whole as fit, and says how many more there are."""
    if len(error.message.encode()) <= MESSAGE_BYTES:
        return error.message
    if not isinstance(error, InvalidArgument) or len(error.violations) < 2:
        return _cut(error.message, MESSAGE_BYTES)
    parts = [f"{field}: {rule}" for field, rule in error.violations]
    room = MESSAGE_BYTES - len(_MORE.format(len(parts)).encode())
    shown, size = 1, len(parts[0].encode())
    while shown < len(parts) and size + 2 + len(parts[shown].encode()) <= room:
        size += 2 + len(parts[shown].encode())
        shown += 1
    more = _MORE.format(len(parts) - shown) if shown < len(parts) else ""
    return _cut("; ".join(parts[:shown]), MESSAGE_BYTES - len(more.encode())) + more


def trailing_details(error: OpmlError) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata that carries ``error``'s structured details (none for most errors): the first
    violations, each cut to a few hundred bytes, as many as fit ``VIOLATION_BYTES`` (one at least)."""
    if not isinstance(error, InvalidArgument):
        return ()
    sent: list[error_details_pb2.BadRequest.FieldViolation] = []
    size = 0
    for field, rule in error.violations:
        field, rule = _cut(field, _FIELD_BYTES), _cut(rule, _RULE_BYTES)
        size += len(field.encode()) + len(rule.encode())
        if sent and size > VIOLATION_BYTES:
            break
        sent.append(error_details_pb2.BadRequest.FieldViolation(field=field, description=rule))
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.BadRequest(field_violations=sent))
    status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=wire_message(error), details=[detail])
    return ((_DETAILS_KEY, status.SerializeToString()),)


def _cut(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` UTF-8 bytes, ending in "..." where it was cut."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[:limit - 3].decode(errors="ignore") + "..."


def field_violations(error: grpc.RpcError) -> Sequence[tuple[str, str]]:
    """The ``(field, rule)`` pairs of a failed call's BadRequest details; empty when it sent none."""
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]  # a failed call is a grpc.Call
    except (ValueError, AttributeError):  # details that contradict the code, or no call to read
        return ()
    violations: list[tuple[str, str]] = []
    for detail in status.details if status else ():
        request = error_details_pb2.BadRequest()
        if detail.Unpack(request):
            violations += [(v.field, v.description) for v in request.field_violations]
    return violations
