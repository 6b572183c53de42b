"""Errors of the routing core, as platform errors so the server interceptor maps them to codes.

A deadline that passes before any replica answers is the shared
:class:`opml_common.errors.DeadlineExceeded`, re-exported here for the routing core's callers.
"""

from __future__ import annotations

from opml_common.errors import DeadlineExceeded, OpmlError

__all__ = ["RETRY", "DeadlineExceeded", "ReplicaFailed"]

# A worker's status code name -> (retriable on another replica, eject this replica); others: neither.
RETRY: dict[str, tuple[bool, bool]] = {
    "UNAVAILABLE": (True, True),          # unreachable, killed mid-request, shutting down
    "CANCELLED": (True, True),            # the worker cancelled the call (it is stopping)
    "NOT_FOUND": (True, True),            # the model is not (or no longer) loaded there
    "RESOURCE_EXHAUSTED": (True, False),  # busy: another replica may have room
}


class ReplicaFailed(OpmlError):
    """A replica answered a call with an error, or could not be reached.

    ``code`` is the replica's status code name, passed on to the caller when no other replica
    can answer instead. ``retriable``: another replica may succeed (the replica is down, busy, or
    lacks the model). ``eject``: the replica itself looks broken, so it is taken out of rotation
    for a while.
    """

    def __init__(self, code: str, message: str, *, retriable: bool, eject: bool, replica: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.retriable = retriable
        self.eject = eject
        self.replica = replica  # kept out of the message: callers need not know the worker's address

    @classmethod
    def of_status(cls, code: str, message: str, *, replica: str) -> ReplicaFailed:
        """A worker's error status as a failure with :data:`RETRY`'s decision (one place for every transport).

        A worker refusing the router's own credentials (UNAUTHENTICATED, PERMISSION_DENIED) is not the
        caller's fault: it becomes UNAVAILABLE, retried elsewhere, with a message pointing at the router.
        """
        if code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            code, message = "UNAVAILABLE", "a worker refused the router's credentials; see the router's logs"
        retriable, eject = RETRY.get(code, (False, False))
        return cls(code, message or code, retriable=retriable, eject=eject, replica=replica)
