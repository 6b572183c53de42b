"""Cron schedules of pipelines: ``minute hour day-of-month month day-of-week``, in UTC.

Each field is ``*``, a number, a range ``a-b``, a list ``a,b``, or any of these with a step
``*/15``, ``1-30/2``; day-of-week 0-6 from Sunday (7 is Sunday too). As in cron, when both
day-of-month and day-of-week are restricted, a day matching either one fires. Small on purpose:
no names (``MON``), no ``@daily``, no seconds.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from opml_common.errors import InvalidArgument

_FIELDS = (("minute", 0, 59), ("hour", 0, 23), ("day-of-month", 1, 31), ("month", 1, 12), ("day-of-week", 0, 7))
_SEARCH_DAYS = 366 * 5  # a schedule that fires never (Feb 30) is refused after this


@dataclass(frozen=True, slots=True)
class Schedule:
    """A parsed cron schedule (:func:`parse_schedule`)."""

    text: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]
    any_day: bool
    any_weekday: bool

    def next_after(self, after: dt.datetime) -> dt.datetime:
        """The first minute strictly after ``after`` (aware, any zone) the schedule fires, in UTC.

        Raises:
            InvalidArgument: it fires on no day in the next five years (``30 0 31 2 *``).
        """
        at = after.astimezone(dt.UTC).replace(second=0, microsecond=0) + dt.timedelta(minutes=1)
        end = at + dt.timedelta(days=_SEARCH_DAYS)
        while at < end:
            if at.month not in self.months or not self._day_matches(at):
                at = (at + dt.timedelta(days=1)).replace(hour=0, minute=0)
                continue
            if at.hour not in self.hours:
                at = (at + dt.timedelta(hours=1)).replace(minute=0)
                continue
            if at.minute in self.minutes:
                return at
            at += dt.timedelta(minutes=1)
        raise InvalidArgument("schedule", f"{self.text!r} fires on no day in the next five years")

    def _day_matches(self, at: dt.datetime) -> bool:
        day = at.day in self.days
        weekday = (at.isoweekday() % 7) in self.weekdays
        if self.any_day and self.any_weekday:
            return True
        if self.any_day:
            return weekday
        if self.any_weekday:
            return day
        return day or weekday


def parse_schedule(text: str, field: str = "schedule") -> Schedule:
    """``text`` as a :class:`Schedule`.

    Raises:
        InvalidArgument: on ``field``, naming the cron field that is wrong and why.
    """
    parts = text.split() if isinstance(text, str) else []
    if len(parts) != 5:
        raise InvalidArgument(field, "must be 5 cron fields (minute hour day-of-month month day-of-week, UTC), "
                                     f"e.g. '0 3 * * *', but got {text!r}")
    values = [_field(part, name, low, high, field) for part, (name, low, high) in zip(parts, _FIELDS, strict=True)]
    weekdays = frozenset(7 if d == 0 else d for d in values[4]) | frozenset(0 if d == 7 else d for d in values[4])
    schedule = Schedule(text, values[0], values[1], values[2], values[3], weekdays,
                        any_day=parts[2] == "*", any_weekday=parts[4] == "*")
    schedule.next_after(dt.datetime(2000, 1, 1, tzinfo=dt.UTC))  # refuse one that never fires
    return schedule


def _field(part: str, name: str, low: int, high: int, field: str) -> frozenset[int]:
    found: set[int] = set()
    for item in part.split(","):
        body, _, step_text = item.partition("/")
        try:
            step = int(step_text) if step_text else 1
            if body == "*":
                start, end = low, high
            elif "-" in body:
                start_text, end_text = body.split("-", 1)
                start, end = int(start_text), int(end_text)
            else:
                start = end = int(body)
                if step_text:
                    end = high
        except ValueError:
            raise InvalidArgument(field, f"{name} field {part!r} must be *, a number, a range a-b or a list, "
                                         "each with an optional /step") from None
        if step < 1 or not low <= start <= end <= high:
            raise InvalidArgument(field, f"{name} field {part!r} must stay within {low}-{high}, "
                                         "ranges low-high and steps >= 1")
        found.update(range(start, end + 1, step))
    return frozenset(found)
