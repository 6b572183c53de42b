"""The MPP's recalibrations, off the label join: each runs on a worker (by default one worker process,
so the boosting fits hold one core and none of the event loop's GIL), at most one per version at a
time; labels that come while one runs count toward the next, started when it ends if they make one due
(so many triggers make one refit, not a queue). The refit's inputs are copied when it starts
(:meth:`MPP.refit_job`), and its result is put in use in one assignment on the event loop
(:meth:`MPP.use`): a window scored meanwhile is scored by the model in use, old or new, whole.

Before, the join awaited the refit (several gradient-boosting fits, seconds on a loaded machine) every
``min_labels`` labels, in the labels agent and in the predictions agent (labels that came before their
prediction), and scoring fell minutes behind the traffic when labels were frequent."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor

from opml_common.process import die_with_parent
from opml_monitoring_scorer.core.mpp import MPP, RefitJob, recalibrated

log = logging.getLogger(__name__)


def worker_process() -> Executor:
    """One worker process (spawned: the service's threads and sockets are not forked into it), killed
    with the service even when the service is SIGKILLed."""
    return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                               initializer=die_with_parent)


class Refits:
    """Background recalibrations of each version's MPP. ``executor``: where the fits run (None: one
    worker process, made when first needed); ``fit``: the function run there (module-level, picklable).
    ``on_done(key, mpp, changed)``: called on the event loop after each one is put in use."""

    def __init__(self, executor: Executor | None = None, *,
                 fit: Callable[[RefitJob], object | None] = recalibrated) -> None:
        self._executor = executor
        self._owned = executor is None
        self._fit = fit
        self._running: dict[str, asyncio.Task] = {}

    def due(self, key: str, mpp: MPP, on_done: Callable[[str, MPP, bool], None]) -> None:
        """Starts a recalibration of ``mpp`` (version ``key``) if it is due and none of its version runs;
        returns at once."""
        if key in self._running or not mpp.due:
            return
        task = asyncio.get_running_loop().create_task(self._run(key, mpp, on_done), name=f"mpp-refit {key}")
        self._running[key] = task
        task.add_done_callback(lambda _: self._running.pop(key, None))

    def running(self, key: str) -> bool:
        return key in self._running

    async def _run(self, key: str, mpp: MPP, on_done: Callable[[str, MPP, bool], None]) -> None:
        if self._executor is None:
            self._executor = worker_process()
        loop = asyncio.get_running_loop()
        while (job := mpp.refit_job()) is not None:  # again while labels that came meanwhile make one due
            try:
                model = await loop.run_in_executor(self._executor, self._fit, job)
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed refit leaves the model in use; the next labels try again
                log.exception("MPP recalibration of %s failed (%d labels): the model in use is kept", key, job.covers)
                return
            on_done(key, mpp, mpp.use(job, model))

    async def idle(self) -> None:
        """Returns when no recalibration runs (tests and benches wait for the model in use to settle)."""
        while self._running:
            await asyncio.gather(*self._running.values(), return_exceptions=True)

    async def stop(self) -> None:
        """Cancels the recalibrations (one in flight is lost; the live rows are in memory anyway) and
        ends the worker process, if this made it."""
        for task in list(self._running.values()):
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)
        if self._owned and self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
