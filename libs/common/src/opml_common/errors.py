"""Domain errors that map to gRPC status codes and survive the wire.

Service cores raise these (they import no grpc); one server interceptor turns them into
status codes and one client helper turns status codes back into these types, so callers of
our client libraries catch ``NotFound``, never a bare ``grpc.RpcError``. Each error carries a
``retriable`` flag that retry loops test instead of class names.
"""

from __future__ import annotations

from collections.abc import Sequence


class OpmlError(Exception):
    """Base of all platform errors. ``code`` is the gRPC status code name."""

    code = "INTERNAL"
    retriable = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(OpmlError):
    """Request fields break rules. The message names the field, shows the value and the rule.

    ``violations`` holds every (field path, rule) pair, so one error can report all that is wrong at
    once (a spec with three mistakes gets three lines, not three round trips); on the wire they travel
    as ``google.rpc.BadRequest`` field violations beside the message. ``field`` is the first one's.
    """

    code = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str) -> None:
        self.violations: tuple[tuple[str, str], ...] = ((field, message),)
        super().__init__(f"{field}: {message}")
        self.field = field

    @classmethod
    def of(cls, violations: Sequence[tuple[str, str]]) -> InvalidArgument:
        """One error for several ``(field, rule)`` violations (at least one), in the order given."""
        if not violations:
            raise ValueError("`violations` must hold at least one (field, rule) pair, but got none")
        error = cls(*violations[0])
        error.violations = tuple(violations)
        error.message = "; ".join(f"{field}: {rule}" for field, rule in violations)
        error.args = (error.message,)
        return error


class NotFound(OpmlError):
    """The named thing does not exist. The message names it."""

    code = "NOT_FOUND"


class AlreadyExists(OpmlError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(OpmlError):
    """The system is not in a state that allows the call (for example, pushing an uncommitted bundle)."""

    code = "FAILED_PRECONDITION"


class PermissionDenied(OpmlError):
    code = "PERMISSION_DENIED"


class Unauthenticated(OpmlError):
    code = "UNAUTHENTICATED"


class ResourceExhausted(OpmlError):
    code = "RESOURCE_EXHAUSTED"
    retriable = True


class Unavailable(OpmlError):
    """A dependency (broker, S3, Redis) cannot be reached right now; the call may be retried."""

    code = "UNAVAILABLE"
    retriable = True


class DeadlineExceeded(OpmlError):
    """The call's deadline passed (or cannot be met) before it finished; a retry may meet a new one."""

    code = "DEADLINE_EXCEEDED"
    retriable = True


class DataLoss(OpmlError):
    """Stored data is corrupt: a blob's content does not match its hash."""

    code = "DATA_LOSS"


ERRORS_BY_CODE: dict[str, type[OpmlError]] = {
    cls.code: cls
    for cls in (OpmlError, NotFound, AlreadyExists, FailedPrecondition, PermissionDenied,
                Unauthenticated, ResourceExhausted, Unavailable, DeadlineExceeded, DataLoss)
}


def from_status(code: str, message: str, violations: Sequence[tuple[str, str]] = ()) -> OpmlError:
    """Rebuild the domain error a server raised from its status code name, message and, for
    INVALID_ARGUMENT, its field violations (parsed from the message when a server sent none)."""
    if code == InvalidArgument.code:
        if violations:
            return InvalidArgument.of(violations)
        field, _, rule = message.partition(": ")
        return InvalidArgument(field, rule or message)
    return ERRORS_BY_CODE.get(code, OpmlError)(message)


def brief(value: object, limit: int = 80) -> str:
    """A repr of ``value`` for an error message, at most ``limit`` characters, whatever its size.

    The whole repr is never built: containers show their first few items and a few levels
    (``reprlib``, without sorting dicts or sets), strings and bytes are cut before they are
    repr'd, and an int of more than 60 digits shows its size instead (a repr of a huge int is
    quadratic, and refused past 4300 digits). Safe on shared or cyclic structures such as an
    expanded YAML alias bomb.
    """
    text = _BRIEF.repr(value)
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


def _brief_repr() -> object:
    import builtins
    import reprlib
    from itertools import islice

    class _Brief(reprlib.Repr):
        def __init__(self) -> None:
            super().__init__()
            self.maxlevel, self.maxdict, self.maxlist, self.maxtuple = 3, 4, 6, 6
            self.maxset = self.maxfrozenset = self.maxdeque = self.maxarray = 6
            self.maxstring, self.maxlong, self.maxother = 60, 60, 60

        def _unsorted(self, x: object, level: int, left: str, right: str, most: int) -> str:
            if not x:
                return left + right
            if level <= 0:
                return left + "..." + right
            items = [self.repr1(item, level - 1) for item in islice(x, most)]  # type: ignore[call-overload]
            if len(x) > most:  # type: ignore[arg-type]
                items.append("...")
            return left + ", ".join(items) + right

        def repr_set(self, x: set[object], level: int) -> str:
            return self._unsorted(x, level, "{", "}", self.maxset)

        def repr_frozenset(self, x: frozenset[object], level: int) -> str:
            return self._unsorted(x, level, "frozenset({", "})", self.maxfrozenset)

        def repr_dict(self, x: dict[object, object], level: int) -> str:
            if not x:
                return "{}"
            if level <= 0:
                return "{...}"
            items = [f"{self.repr1(key, level - 1)}: {self.repr1(x[key], level - 1)}"
                     for key in islice(x, self.maxdict)]
            if len(x) > self.maxdict:
                items.append("...")
            return "{" + ", ".join(items) + "}"

        def repr_int(self, x: int, level: int) -> str:
            if x.bit_length() > 200:  # about 60 digits
                return f"<int of {x.bit_length()} bits>"
            return builtins.repr(x)

        def repr_bytes(self, x: bytes, level: int) -> str:
            cut = builtins.repr(bytes(x[: self.maxstring]))
            return cut if len(x) <= self.maxstring else f"{cut}... ({len(x)} bytes)"

        def repr_bytearray(self, x: bytearray, level: int) -> str:
            return "bytearray(" + self.repr_bytes(bytes(x[: self.maxstring + 1]), level) + ")"

        def repr_memoryview(self, x: memoryview, level: int) -> str:
            return f"<memoryview of {x.nbytes} bytes>"

        def repr_ndarray(self, x: object, level: int) -> str:
            return f"<array shape={getattr(x, 'shape', '?')} dtype={getattr(x, 'dtype', '?')}>"

    return _Brief()


_BRIEF = _brief_repr()
