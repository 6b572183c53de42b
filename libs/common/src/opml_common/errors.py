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
