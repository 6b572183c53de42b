"""Rich error details on the wire (google.rpc.Status in ``grpc-status-details-bin``), both ways.

INVALID_ARGUMENT carries a ``google.rpc.BadRequest`` with one field violation per broken rule, beside
the human message, so a client in any language reads *which* field was wrong without parsing text.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from opml_common.errors import InvalidArgument, OpmlError

_DETAILS_KEY = "grpc-status-details-bin"


def trailing_details(error: OpmlError) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata that carries ``error``'s structured details (none for most errors)."""
    if not isinstance(error, InvalidArgument):
        return ()
    request = error_details_pb2.BadRequest(field_violations=[
        error_details_pb2.BadRequest.FieldViolation(field=field, description=rule)
        for field, rule in error.violations])
    detail = any_pb2.Any()
    detail.Pack(request)
    status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=error.message, details=[detail])
    return ((_DETAILS_KEY, status.SerializeToString()),)


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
