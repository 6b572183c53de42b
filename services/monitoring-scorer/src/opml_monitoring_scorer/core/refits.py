"""The MPP's recalibrations, off the label join: each runs on a worker (by default one worker process,
so the boosting fits hold one core and none of the event loop's GIL), at most one per version at a
time; labels that come while one runs count toward the next (so many triggers make one refit, not a
queue). The refit's inputs are copied when it starts (:meth:`MPP.refit_job`), and its result is put in
use in one assignment on the event loop (:meth:`MPP.use`): a window scored meanwhile is scored by the
model in use, old or new, whole.

When one starts: ``min_labels`` new labelled rows make one due; fewer start one once labels have stopped
coming for ``quiet_s`` (each batch of labels restarts that wait). Without the second rule the labels
after the last refit that do not make ``min_labels`` were never learned: the join adds labels in batches,
so a first refit could start at 250 of 400 labels, and the 150 left (or the tail of any burst) stayed
out of every refit. The rule is checked where the version's state changes, so no label is left behind
by construction: after labels are added and after each refit ends, a version either has a refit
running (its end checks again), a quiet wait armed (it refits every unfitted label), or no unfitted
label. A refit that ends with fewer than ``min_labels`` labels that came during it arms the wait too,
rather than starting another at once: that alone would miss the labels that come after a refit ends,
and while labels keep coming they make ``min_labels`` anyway.

A refit that fails (an exception in the fit, or the worker process lost: a new one is made) leaves the
model in use and gives its labels back to the next one (:meth:`MPP.refit_failed`), which starts by itself after a wait:
``quiet_s``, doubled after each failure in a row up to ``retry_max_s``, and not restarted by the labels
that come meanwhile (the retry takes them too). Before, a failed refit's labels were refitted only once
``min_labels`` more came, or never. One that always fails is tried once per ``retry_max_s``, each failure
logged and reported (``on_failed``: the scorer counts it).

Before, the join awaited the refit (several gradient-boosting fits, seconds on a loaded machine) every
``min_labels`` labels, in the labels agent and in the predictions agent (labels that came before their
prediction), and scoring fell minutes behind the traffic when labels were frequent."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Callable
from concurrent.futures import BrokenExecutor, Executor, ProcessPoolExecutor

from opml_common.process import die_with_parent
from opml_common.retry import Backoff
from opml_monitoring_scorer.core.mpp import MPP, RefitJob, recalibrated

log = logging.getLogger(__name__)


def worker_process() -> Executor:
    """One worker process (spawned: the service's threads and sockets are not forked into it), killed
    with the service even when the service is SIGKILLed."""
    return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                               initializer=die_with_parent)


QUIET_S = 5.0
"""Seconds without a new label after which fewer than ``min_labels`` unfitted labels start a refit."""
RETRY_MAX_S = 300.0
"""Longest wait before a failed refit is tried again (the waits double from ``quiet_s``)."""
Done = Callable[[str, MPP, bool], None]
Failed = Callable[[str], None]


class Refits:
    """Background recalibrations of each version's MPP. ``executor``: where the fits run (None: one
    worker process, made when first needed); ``fit``: the function run there (module-level, picklable);
    ``quiet_s``: how long labels must have stopped coming before fewer than ``min_labels`` new ones are
    refitted, and the first wait before a failed refit is tried again; ``retry_max_s``: the longest such
    wait. ``on_done(key, mpp, changed)``: called on the event loop after each one is put in use;
    ``on_failed(key)``: after each one that failed."""

    def __init__(self, executor: Executor | None = None, *,
                 fit: Callable[[RefitJob], object | None] = recalibrated, quiet_s: float = QUIET_S,
                 retry_max_s: float = RETRY_MAX_S) -> None:
        self._executor = executor
        self._owned = executor is None
        self._fit = fit
        self.quiet_s = quiet_s
        self.retry = Backoff(base_s=quiet_s, max_s=max(quiet_s, retry_max_s))
        self._running: dict[str, asyncio.Task] = {}
        self._waiting: dict[str, asyncio.Task] = {}
        """Per version, the quiet wait or the wait before a retry armed (never while one of its refits runs)."""
        self._failures: dict[str, int] = {}
        """Per version, its refits that failed in a row (none since its last that succeeded)."""

    def due(self, key: str, mpp: MPP, on_done: Done, on_failed: Failed | None = None) -> None:
        """Labels were added to ``mpp`` (version ``key``): restarts its quiet wait, and, if none of its
        refits runs, starts one if they make it due, or else arms the wait; returns at once. A wait
        before a retry is left as it is: the retry takes these labels too."""
        if key in self._failures and key in self._waiting:
            return
        if (waiting := self._waiting.pop(key, None)) is not None:
            waiting.cancel()
        if key not in self._running:  # else its end checks again
            self._next(key, mpp, on_done, on_failed)

    def running(self, key: str) -> bool:
        return key in self._running

    def failures(self, key: str) -> int:
        """The refits of ``key`` that failed in a row (0: its last succeeded, or none ran)."""
        return self._failures.get(key, 0)

    def _next(self, key: str, mpp: MPP, on_done: Done, on_failed: Failed | None) -> None:
        if (failures := self._failures.get(key, 0)) and mpp.unfitted > 0:  # never at once after a failure
            self._arm(key, mpp, on_done, on_failed, self.retry.delay(failures - 1))
        elif mpp.due:
            self._start(key, mpp, on_done, on_failed, quiet=False)
        elif mpp.unfitted > 0:
            self._arm(key, mpp, on_done, on_failed, self.quiet_s)

    def _arm(self, key: str, mpp: MPP, on_done: Done, on_failed: Failed | None, delay: float) -> None:
        self._waiting[key] = asyncio.get_running_loop().create_task(
            self._quiet(key, mpp, on_done, on_failed, delay), name=f"mpp-refit-wait {key}")

    async def _quiet(self, key: str, mpp: MPP, on_done: Done, on_failed: Failed | None, delay: float) -> None:
        await asyncio.sleep(delay)  # a quiet wait is cancelled by the next batch of labels
        del self._waiting[key]
        self._start(key, mpp, on_done, on_failed, quiet=True)

    def _start(self, key: str, mpp: MPP, on_done: Done, on_failed: Failed | None, *, quiet: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._run(key, mpp, on_done, on_failed, quiet),
                                                      name=f"mpp-refit {key}")
        self._running[key] = task
        task.add_done_callback(lambda done: self._ended(key, mpp, on_done, on_failed, done))

    def _ended(self, key: str, mpp: MPP, on_done: Done, on_failed: Failed | None, task: asyncio.Task) -> None:
        del self._running[key]
        if not task.cancelled():  # the labels that came while it ran (or a failed one's): a refit, or a wait
            self._next(key, mpp, on_done, on_failed)

    async def _run(self, key: str, mpp: MPP, on_done: Done, on_failed: Failed | None, quiet: bool) -> None:
        job = mpp.refit_job(quiet=quiet)
        if job is None:
            return
        if self._executor is None:
            self._executor = worker_process()
        try:
            model = await asyncio.get_running_loop().run_in_executor(self._executor, self._fit, job)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the model in use is kept; its labels are tried again after a wait
            if isinstance(exc, BrokenExecutor) and self._owned:  # the worker process died (killed, out of
                self._executor.shutdown(wait=False, cancel_futures=True)  # memory): the retry makes a new one
                self._executor = None
            mpp.refit_failed(job)
            failures = self._failures[key] = self._failures.get(key, 0) + 1
            log.exception("MPP recalibration of %s failed (%d labels, %d failure(s) in a row): the model in use "
                          "is kept, tried again in %.0f s", key, job.covers, failures,
                          self.retry.delay(failures - 1))
            if on_failed is not None:
                on_failed(key)
            return
        self._failures.pop(key, None)
        on_done(key, mpp, mpp.use(job, model))

    async def idle(self) -> None:
        """Returns when no recalibration runs or waits for labels to stop coming (tests and benches wait
        for the model in use to settle)."""
        while self._running or self._waiting:
            await asyncio.gather(*self._running.values(), *self._waiting.values(), return_exceptions=True)

    async def stop(self) -> None:
        """Cancels the quiet waits and the recalibrations (one in flight is lost; the live rows are in
        memory anyway) and ends the worker process, if this made it."""
        for task in [*self._waiting.values(), *self._running.values()]:
            task.cancel()
        await asyncio.gather(*self._waiting.values(), *self._running.values(), return_exceptions=True)
        self._waiting.clear()
        self._failures.clear()
        if self._owned and self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
