"""When to run a failed job again: a pure decision the orchestrator loop asks after each failed run.

The executor only reports that a run ended (a ``JobEvent`` with ``retriable``); the loop asks
:meth:`RetryPolicy.next_delay` and, given a delay, launches the job again that much later with the
next ``attempt``.
"""

from __future__ import annotations

from dataclasses import dataclass

from opml_common.errors import InvalidArgument
from opml_common.retry import Backoff
from opml_job_orchestrator.executor.base import check_seconds


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Up to ``max_retries`` retries, the n-th (from 0) after ``base_delay_s * multiplier**n``, capped at
    ``max_delay_s`` (the platform's shared :class:`~opml_common.retry.Backoff`). Keyword-only, checked
    when built; deterministic (no jitter), so tests and replays agree.
    """

    max_retries: int
    backoff: Backoff

    def __init__(self, *, max_retries: int, base_delay_s: float, max_delay_s: float, multiplier: float = 2.0) -> None:
        if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
            raise InvalidArgument("max_retries", f"`max_retries` must be an integer >= 0, but got {max_retries!r}.")
        base = check_seconds(base_delay_s, "base_delay_s", positive=False)
        cap = check_seconds(max_delay_s, "max_delay_s", positive=False)
        if cap < base:
            raise InvalidArgument("max_delay_s", f"`max_delay_s` must be >= `base_delay_s` ({base_delay_s!r}), "
                                                 f"but got {max_delay_s!r}.")
        object.__setattr__(self, "max_retries", max_retries)
        object.__setattr__(self, "backoff", Backoff(base_s=base, max_s=cap, multiplier=multiplier))

    def next_delay(self, retries_done: int, *, retriable: bool = True) -> float | None:
        """Seconds to wait before the next run, after ``retries_done`` retries already failed; None: give up.

        ``retriable`` is the failed run's ``JobEvent.retriable``: a run that cannot succeed again (its
        command does not exist) is never retried.

        Raises:
            InvalidArgument: ``retries_done`` is not an integer >= 0.
        """
        if not isinstance(retries_done, int) or isinstance(retries_done, bool) or retries_done < 0:
            raise InvalidArgument("retries_done", f"`retries_done` must be an integer >= 0, but got {retries_done!r}.")
        if not retriable or retries_done >= self.max_retries:
            return None
        return self.backoff.delay(retries_done)
