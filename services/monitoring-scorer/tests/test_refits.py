"""When the MPP's background recalibrations start (core/refits.py): no label is left out of every refit,
however the labels are batched, and many triggers make one refit, not a queue. Pure logic: the fits run
on a thread, no broker or Redis."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import pytest

from opml_monitoring_scorer.core import refits as refits_module
from opml_monitoring_scorer.core.mpp import MPP, RefitJob
from opml_monitoring_scorer.core.reference import Task
from opml_monitoring_scorer.core.refits import Refits
from opml_monitoring_scorer.synthetic import SyntheticWorld

SETTLED_S = 120.0
"""A safety bound on waiting for a refit (the tests wait for events, not for time)."""


class Fits:
    """The refit, recorded (the labels each covered) and held until :meth:`release`; the model in use
    stays the reference's own (these tests are about when refits run, not what they learn)."""

    def __init__(self, *, held: bool = False) -> None:
        self.jobs: list[int] = []
        self.started = threading.Event()
        self.released = threading.Event()
        if not held:
            self.released.set()

    def __call__(self, job: RefitJob) -> object | None:
        self.jobs.append(job.covers)
        self.started.set()
        assert self.released.wait(timeout=SETTLED_S), "the test never released the refit"

    def release(self) -> None:
        self.released.set()


def done(key: str, mpp: MPP, changed: bool) -> None:
    """``on_done``: nothing to count here (the scorer's sets its metrics)."""


async def settled(refits: Refits) -> None:
    """Once no refit runs and none waits for labels to stop coming."""
    await asyncio.wait_for(refits.idle(), SETTLED_S)


@pytest.fixture
def world() -> SyntheticWorld:
    return SyntheticWorld(Task.BINARY, seed=3)


@pytest.fixture
def mpp(world: SyntheticWorld) -> MPP:
    return MPP(world.reference(600), min_labels=200)


def add(mpp: MPP, world: SyntheticWorld, count: int) -> None:
    rows = world.rows(count)
    mpp.add_labels(rows.features, rows.outputs, rows.labels)


async def test_labels_that_came_during_a_refit_and_do_not_make_one_due_are_refitted_once_labels_stop(
        mpp: MPP, world: SyntheticWorld) -> None:
    """A batch crossing 200 starts a refit on 250; 150 more come while it runs. They never make one due
    by count, so a refit on all 400 must still run once labels stop coming."""
    fits = Fits(held=True)
    with ThreadPoolExecutor(max_workers=1) as executor:
        refits = Refits(executor, fit=fits, quiet_s=0.05)
        add(mpp, world, 250)
        refits.due("m/1", mpp, done)
        assert await asyncio.to_thread(fits.started.wait, SETTLED_S), "250 labels started a refit"
        add(mpp, world, 150)
        refits.due("m/1", mpp, done)
        fits.release()
        await settled(refits)
        assert fits.jobs == [250, 400] and mpp.covered == 400 and mpp.refits == 2
        await refits.stop()


async def test_labels_below_min_labels_after_a_refit_ended_are_refitted_once_labels_stop(
        mpp: MPP, world: SyntheticWorld) -> None:
    fits = Fits()
    with ThreadPoolExecutor(max_workers=1) as executor:
        refits = Refits(executor, fit=fits, quiet_s=0.05)
        add(mpp, world, 250)
        refits.due("m/1", mpp, done)
        await settled(refits)
        assert fits.jobs == [250]
        add(mpp, world, 150)
        refits.due("m/1", mpp, done)
        await settled(refits)
        assert fits.jobs == [250, 400] and mpp.refits == 2
        await refits.stop()


async def test_batches_that_keep_coming_restart_the_quiet_time_and_make_one_refit(
        mpp: MPP, world: SyntheticWorld) -> None:
    """Ten batches of 10 in one turn of the event loop (no quiet time between them): one refit on 100,
    not one a batch."""
    fits = Fits()
    with ThreadPoolExecutor(max_workers=1) as executor:
        refits = Refits(executor, fit=fits, quiet_s=0.05)
        for _ in range(10):
            add(mpp, world, 10)
            refits.due("m/1", mpp, done)
        await settled(refits)
        assert fits.jobs == [100] and mpp.covered == 100
        await refits.stop()


async def test_no_refit_when_a_refit_covered_every_label(mpp: MPP, world: SyntheticWorld) -> None:
    """200 labels make one refit; with nothing unfitted after it, nothing waits for labels to stop."""
    fits = Fits()
    with ThreadPoolExecutor(max_workers=1) as executor:
        refits = Refits(executor, fit=fits, quiet_s=0.05)
        add(mpp, world, 200)
        refits.due("m/1", mpp, done)
        await settled(refits)
        assert fits.jobs == [200]
        refits.due("m/1", mpp, done)  # called again with no new label: nothing to refit
        await settled(refits)
        assert fits.jobs == [200] and mpp.refits == 1
        await refits.stop()


async def test_a_stop_cancels_the_wait_for_labels_to_stop(mpp: MPP, world: SyntheticWorld) -> None:
    fits = Fits()
    with ThreadPoolExecutor(max_workers=1) as executor:
        refits = Refits(executor, fit=fits, quiet_s=3600.0)
        add(mpp, world, 50)
        refits.due("m/1", mpp, done)
        await refits.stop()
        await settled(refits)
        assert fits.jobs == [] and mpp.refits == 0


class FailingFits(Fits):
    """The refit failing its first ``failures`` calls (all, when None), each call's time recorded."""

    def __init__(self, failures: int | None, *, held: bool = False) -> None:
        super().__init__(held=held)
        self.failures = failures
        self.times: list[float] = []
        self.calls = threading.Semaphore(0)

    def __call__(self, job: RefitJob) -> object | None:
        self.times.append(time.monotonic())
        self.calls.release()
        super().__call__(job)
        if self.failures is None or len(self.jobs) <= self.failures:
            raise RuntimeError("the worker process died")
        return None


async def test_a_failed_refit_is_tried_again_by_itself_with_its_labels(mpp: MPP, world: SyntheticWorld) -> None:
    """A refit that failed left its labels out until min_labels more came (or for ever): they had been
    taken as fitted. It is tried again after a wait, with them and those that came since, and each
    failure is reported."""
    fits, failed = FailingFits(2, held=True), []
    with ThreadPoolExecutor(max_workers=1) as executor:
        refits = Refits(executor, fit=fits, quiet_s=0.05)
        add(mpp, world, 250)
        refits.due("m/1", mpp, done, failed.append)
        assert await asyncio.to_thread(fits.started.wait, SETTLED_S), "250 labels started a refit"
        add(mpp, world, 30)  # while the first one, which fails, runs
        refits.due("m/1", mpp, done, failed.append)
        fits.release()
        await settled(refits)
        assert fits.jobs == [250, 280, 280] and failed == ["m/1", "m/1"]
        assert mpp.covered == 280 and mpp.refits == 1 and mpp.unfitted == 0 and refits.failures("m/1") == 0
        await refits.stop()


async def test_a_refit_that_always_fails_is_tried_again_ever_later_and_loses_no_label(
        mpp: MPP, world: SyntheticWorld) -> None:
    """Retried at once (or on every batch of labels) a refit that always fails would hold the worker for
    ever: the waits double from quiet_s up to retry_max_s, and labels that come meanwhile neither
    restart nor shorten them (due by count, they would start one at once). No label is lost: after
    each failure every label taken is still to be refitted."""
    fits, failed = FailingFits(None), []
    with ThreadPoolExecutor(max_workers=1) as executor:
        refits = Refits(executor, fit=fits, quiet_s=0.02, retry_max_s=0.08)
        add(mpp, world, 50)
        refits.due("m/1", mpp, done, lambda key: failed.append((mpp.unfitted, mpp.labels)))
        for _ in range(5):
            assert await asyncio.to_thread(fits.calls.acquire, True, SETTLED_S)
            add(mpp, world, 200)  # makes one due by count
            refits.due("m/1", mpp, done, lambda key: failed.append((mpp.unfitted, mpp.labels)))
        gaps = [later - earlier for earlier, later in itertools.pairwise(fits.times[:5])]
        assert all(gap >= wait for gap, wait in zip(gaps, [0.02, 0.04, 0.08, 0.08], strict=True)), gaps
        assert len(failed) >= 4 and all(unfitted == labels for unfitted, labels in failed), failed
        assert mpp.refits == 0 and refits.failures("m/1") >= 4
        await refits.stop()


class DeadWorker(ThreadPoolExecutor):
    """A worker process that died: every refit submitted to it fails as ProcessPoolExecutor's do then."""

    def submit(self, fn, /, *args, **kwargs):
        raise BrokenProcessPool("a child process terminated abruptly")


async def test_a_refit_whose_worker_process_died_is_tried_again_in_a_new_one(
        mpp: MPP, world: SyntheticWorld, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker process that died (killed, out of memory) left its pool broken: every later refit failed
    at once. The retry runs in a new worker process."""
    made: list[ThreadPoolExecutor] = [DeadWorker(max_workers=1), ThreadPoolExecutor(max_workers=1)]
    workers = iter(made)
    monkeypatch.setattr(refits_module, "worker_process", lambda: next(workers))
    fits, failed = Fits(), []
    refits = Refits(fit=fits, quiet_s=0.05)  # owns its worker processes
    add(mpp, world, 250)
    refits.due("m/1", mpp, done, failed.append)
    await settled(refits)
    assert failed == ["m/1"] and fits.jobs == [250] and mpp.refits == 1, "retried in the second worker"
    await refits.stop()
    for executor in made:
        executor.shutdown()
