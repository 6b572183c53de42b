"""Segments of a model version (after NannyML's segmentation): monitoring.yaml's ``segment:
{parameter: P}`` names a KServe v2 request parameter (tritonclient's ``parameters={"line": "3"}``, a
string or an integer) whose value splits the version's predictions, so each value gets its own
windows, estimates, drift, label truth and alert states, besides the version's own (segment "",
every prediction, as without segments).

The segments are the clients' values, so they are bounded: a version has at most ``MAX_SEGMENTS``
of them, admitted in the order they first come (which the stream makes the order of the source
partition's offsets, so a replay admits the same ones); a later value, a value over
``MAX_SEGMENT_CHARS`` characters, or one of another type (a float, a bool) goes to the segment
``OTHER``. A prediction without the parameter (or with an empty value, or that carries no request)
is in the version's windows only.
"""

from __future__ import annotations

from collections.abc import Iterable

from tritonclient.grpc import service_pb2 as pb

MAX_SEGMENTS = 64
"""Most segments of one version (besides ``OTHER``)."""
MAX_SEGMENT_CHARS = 64
OTHER = "other"
"""The segment of the values past the bound."""
SEPARATOR = "#"
"""Between a version's key (model/version) and a segment in the keys of a segment's state."""


def window_key(mv: str, segment: str) -> str:
    """The key of a version's (``segment`` "") or a segment's windows, truth, rules and alerts."""
    return f"{mv}{SEPARATOR}{segment}" if segment else mv


def parameter_value(infer_request: bytes, parameter: str) -> str | None:
    """The request's value of ``parameter`` as text: "" when the request lacks it (or carries no
    request), None when it is neither a string nor an integer. A request that does not parse has
    none ("": the decoder rejects it)."""
    if not infer_request:
        return ""
    try:
        request = pb.ModelInferRequest.FromString(infer_request)
    except Exception:  # noqa: BLE001 - protobuf raises DecodeError and friends; decode reports it
        return ""
    if parameter not in request.parameters:
        return ""
    value = request.parameters[parameter]
    kind = value.WhichOneof("parameter_choice")
    if kind == "string_param":
        return value.string_param
    if kind in ("int64_param", "uint64_param"):
        return str(getattr(value, kind))
    return None


class SegmentBook:
    """One version's segments: :meth:`admit` maps a parameter value to its segment, admitting at most
    ``limit`` values (``known``: the ones admitted before, e.g. those with windows closed)."""

    def __init__(self, known: Iterable[str] = (), *, limit: int = MAX_SEGMENTS) -> None:
        self.limit = limit
        self.known: set[str] = {k for k in known if k and k != OTHER}

    def admit(self, value: str | None) -> tuple[str, bool]:
        """(the value's segment, whether it went to ``OTHER`` for the bound)."""
        if value == "":
            return "", False
        if value is None or len(value) > MAX_SEGMENT_CHARS:
            return OTHER, True
        if value in self.known or value == OTHER:
            return value, False
        if len(self.known) >= self.limit:
            return OTHER, True
        self.known.add(value)
        return value, False
