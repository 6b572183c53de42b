"""The MPP's recalibration runs in the background (core/refits.py): labels keep joining and windows keep
closing while a refit runs, at most one runs per version (labels that come meanwhile make one more, not
one each), and the windows closed after it is put in use are scored by the new model. Real Redis, no
broker."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis.asyncio as aioredis
from opml.monitoring.v1 import label_events_pb2
from prometheus_client import CollectorRegistry

from opml_common.events import RecordingEmitter
from opml_common.metrics import ServiceMetrics
from opml_monitoring_scorer.core.mpp import RefitJob, recalibrated
from opml_monitoring_scorer.core.reference import Task
from opml_monitoring_scorer.core.refits import Refits
from opml_monitoring_scorer.core.scorer import Scorer, dump_reference
from opml_monitoring_scorer.metrics import ScorerMetrics
from opml_monitoring_scorer.state import MonitorStore
from opml_monitoring_scorer.synthetic import SyntheticWorld

from .test_scorer import CONFIG, events_of, origin

pytestmark = pytest.mark.timeout(600)
WINDOW = 100  # CONFIG's window count; the MPP refits every 200 labels


class BlockedFit:
    """The refit, held until :meth:`release` (a thread of the test's executor waits on it)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.released = threading.Event()
        self.jobs: list[int] = []

    def __call__(self, job: RefitJob) -> object | None:
        self.jobs.append(job.covers)
        self.started.set()
        assert self.released.wait(timeout=300), "the test never released the refit"
        return recalibrated(job)

    def release(self) -> None:
        self.released.set()


async def scorer_with(refits: Refits, world: SyntheticWorld):
    files = {"reference.npz": dump_reference(world.reference(2000)), "monitoring.yaml": CONFIG}

    async def load(context: str, ref: str):
        return "uuid-1", files

    client = aioredis.Redis(host="127.0.0.1", port=6379)
    prefix = f"opml-test:{uuid.uuid4().hex[:8]}:"
    registry = CollectorRegistry()
    metrics = ScorerMetrics(ServiceMetrics("monitoring-scorer", registry))
    scorer = Scorer(store=MonitorStore(client, prefix=prefix, retention_s=600), emitter=RecordingEmitter(),
                    metrics=metrics, load_bundle=load, refits=refits)
    await scorer.register("m", "1", "ctx", "ref")
    return scorer, client, prefix, registry


async def cleanup(scorer: Scorer, client: aioredis.Redis, prefix: str) -> None:
    await scorer.refits.stop()
    keys = await client.keys(prefix + "*")
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def close(scorer: Scorer, index: int, events: list[tuple[str, bytes]]) -> dict:
    for rid, raw in events:
        await scorer.on_prediction_joinable("m/1", index, raw, rid)
    await scorer.close_window("m/1", index, [raw for _, raw in events], time.time(), time.time())
    (record,) = await scorer.store.windows("m/1", before=index + 1, limit=1)
    assert record["index"] == index
    return record


async def label(scorer: Scorer, rid: str, value: float) -> str:
    event = label_events_pb2.LabelObserved(request_id=rid, values=[value]).SerializeToString()
    return await scorer.on_label(event, origin(f"e-{rid}"))


async def test_labels_join_and_windows_close_while_a_refit_runs_and_later_windows_use_the_new_model() -> None:
    world = SyntheticWorld(Task.BINARY, seed=21)
    fit = BlockedFit()
    scorer, client, prefix, registry = await scorer_with(Refits(ThreadPoolExecutor(max_workers=1), fit=fit), world)
    world.flipped = True  # after the reference: a concept shift, the labels teach the MPP where the model now errs
    try:
        mpp = scorer.get("m/1").monitor.mpp
        rows = world.rows(WINDOW * 5)
        events = events_of(rows, 0)
        for index in (0, 1):
            await close(scorer, index, events[index * WINDOW:(index + 1) * WINDOW])
        for i in range(2 * WINDOW):  # the 200th label makes a refit due: it starts, held by the test
            assert await label(scorer, f"r{i}", rows.labels[i]) == "joined"
        assert fit.started.wait(timeout=120), "the 200th label started a refit"
        # the refit is held: labels keep joining (by the labels' path, and parked ones by the
        # predictions' path) and windows keep closing, scored by the reference's own model
        for i in range(2 * WINDOW, 3 * WINDOW):
            assert await label(scorer, f"r{i}", rows.labels[i]) == "parked"
        before = await close(scorer, 2, events[2 * WINDOW:3 * WINDOW])
        assert before["labelled"] == WINDOW, "the parked labels joined as their predictions came"
        assert before["mpp_labels"] == 0, "scored by the model in use: the reference's"
        for i in range(3 * WINDOW, 4 * WINDOW):
            await scorer.on_prediction_joinable("m/1", 3, events[i][1], events[i][0])
            assert await label(scorer, f"r{i}", rows.labels[i]) == "joined"
        assert not fit.released.is_set() and scorer.refits.running("m/1") and mpp.refits == 0
        assert fit.jobs == [2 * WINDOW], "one refit in flight, whatever the labels that came since"
        fit.release()
        await scorer.refits.idle()
        # the 200 labels that came while it ran made one more refit, on all 400
        assert fit.jobs == [2 * WINDOW, 4 * WINDOW] and mpp.refits == 2 and mpp.covered == 4 * WINDOW
        assert mpp.fitted_on == 4 * WINDOW, "a refit on the concept shift's labels replaced the reference's model"
        await scorer.close_window("m/1", 3, [raw for _, raw in events[3 * WINDOW:4 * WINDOW]], time.time(),
                                  time.time())
        record = await close(scorer, 4, events[4 * WINDOW:])
        assert record["mpp_labels"] == 4 * WINDOW, "the window after the swap is scored by the new model"
        assert record["mpp"] < before["mpp"] - 0.05, "the new model sees the concept shift the reference's missed"
        assert registry.get_sample_value("opml_monitoring_scorer_mpp_recalibration_labels",
                                         {"model": "m", "version": "1"}) == 4 * WINDOW
    finally:
        fit.release()
        await cleanup(scorer, client, prefix)


async def test_a_failed_refit_is_counted_and_tried_again_by_itself() -> None:
    """A refit that failed was logged only, and its 200 labels were refitted only once 200 more came:
    it is counted (mpp_recalibration_failures_total) and tried again after the quiet time, on them."""
    world = SyntheticWorld(Task.BINARY, seed=21)
    jobs: list[int] = []

    def fails_once(job: RefitJob) -> object | None:
        jobs.append(job.covers)
        if len(jobs) == 1:
            raise MemoryError("the refit's worker ran out of memory")
        return recalibrated(job)

    scorer, client, prefix, registry = await scorer_with(
        Refits(ThreadPoolExecutor(max_workers=1), fit=fails_once, quiet_s=0.05), world)
    try:
        rows = world.rows(2 * WINDOW)
        events = events_of(rows, 0)
        for index in (0, 1):
            await close(scorer, index, events[index * WINDOW:(index + 1) * WINDOW])
        for i in range(2 * WINDOW):
            assert await label(scorer, f"r{i}", rows.labels[i]) == "joined"
        await scorer.refits.idle()
        mpp = scorer.get("m/1").monitor.mpp
        assert jobs == [2 * WINDOW, 2 * WINDOW] and mpp.refits == 1 and mpp.covered == 2 * WINDOW
        series = {"model": "m", "version": "1"}
        assert registry.get_sample_value("opml_monitoring_scorer_mpp_recalibration_failures_total", series) == 1
        assert registry.get_sample_value("opml_monitoring_scorer_mpp_recalibration_labels", series) == 2 * WINDOW
    finally:
        await cleanup(scorer, client, prefix)


async def test_the_default_worker_process_refits_and_the_result_is_put_in_use() -> None:
    world = SyntheticWorld(Task.BINARY, seed=21)
    scorer, client, prefix, _ = await scorer_with(Refits(), world)
    world.flipped = True
    try:
        mpp = scorer.get("m/1").monitor.mpp
        rows = world.rows(2 * WINDOW)
        events = events_of(rows, 0)
        await close(scorer, 0, events[:WINDOW])
        await close(scorer, 1, events[WINDOW:])
        for i in range(2 * WINDOW):
            assert await label(scorer, f"r{i}", rows.labels[i]) == "joined"
        await scorer.refits.idle()
        assert mpp.refits == 1 and mpp.covered == 2 * WINDOW and mpp.fitted_on == 2 * WINDOW
    finally:
        await cleanup(scorer, client, prefix)


async def test_a_label_whose_prediction_comes_between_its_look_up_and_its_parking_is_joined() -> None:
    """Seen in the stream bench with both agents busy (one label of 10,000 never joined): the labels
    agent found no prediction, the predictions agent then kept it and took the labels parked so far
    (none), and the label was parked after, to wait for a prediction that had come."""
    world = SyntheticWorld(Task.BINARY, seed=21)
    scorer, client, prefix, _ = await scorer_with(Refits(ThreadPoolExecutor(max_workers=1)), world)
    try:
        rows = world.rows(WINDOW)
        events = events_of(rows, 0)
        look_up = scorer.store.find_predictions
        raced = []

        async def prediction_comes_meanwhile(request_ids: list[str]):
            found = await look_up(request_ids)
            if request_ids == ["r0"] and not raced:
                raced.append(found[0])
                await scorer.on_prediction_joinable("m/1", 0, events[0][1], "r0")
            return found

        scorer.store.find_predictions = prediction_comes_meanwhile
        assert await label(scorer, "r0", rows.labels[0]) == "joined"
        assert raced == [None], "the label looked before its prediction was kept"
        record = await close(scorer, 0, events)
        assert record["labelled"] == 1
    finally:
        await cleanup(scorer, client, prefix)
