"""Capped exponential backoff: the one delay rule every retry loop of the platform uses.

Deterministic (no jitter), so tests and replays agree; callers that fan out many retries at once
can add their own jitter on top.
"""

from __future__ import annotations

from dataclasses import dataclass

from opml_common.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class Backoff:
    """The n-th retry (counting from 0) waits ``base_s * multiplier**n`` seconds, at most ``max_s``.

    Raises:
        InvalidArgument: from the constructor, naming the field, when a value is out of range.
    """

    base_s: float
    max_s: float
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        for name in ("base_s", "max_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
                raise InvalidArgument(name, f"`{name}` must be a number of seconds >= 0, but got {value!r}.")
        if self.max_s < self.base_s:
            raise InvalidArgument("max_s", f"`max_s` must be >= `base_s` ({self.base_s!r}), but got {self.max_s!r}.")
        if isinstance(self.multiplier, bool) or not isinstance(self.multiplier, int | float) \
                or not 1 <= self.multiplier < 1e6:
            raise InvalidArgument("multiplier", f"`multiplier` must be a number in [1, 1e6), but got {self.multiplier!r}.")

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (0 = the first retry)."""
        delay = float(self.base_s)
        for _ in range(retry):
            if delay >= self.max_s or delay == 0:
                break
            delay *= self.multiplier
        return min(delay, self.max_s)
