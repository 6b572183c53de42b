"""The controller and its store as long-lived parts (opml_common.lifecycle.Component): started once,
stopped once, in ``async with``; the controller's stop leaves the trials' jobs running. Against the
machine's real Redis (the records and the Optuna journal) and an orchestrator fake whose jobs run on."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
import yaml
from opml.jobs.v1 import jobs_pb2

from opml_automl_controller import controller as controller_module
from opml_automl_controller.controller import Controller
from opml_automl_controller.jobs import JobView, TrialJobs
from opml_automl_controller.state import ExperimentRecord, ExperimentStore
from opml_common.events import RecordingEmitter

REDIS = "redis://127.0.0.1:6379/0"
EXPERIMENT = yaml.safe_dump({
    "apiVersion": "kubeflow.org/v1beta1", "kind": "Experiment", "metadata": {"name": "held"},
    "spec": {"objective": {"type": "minimize", "objectiveMetricName": "loss"},
             "algorithm": {"algorithmName": "random"}, "parallelTrialCount": 2, "maxTrialCount": 4,
             "parameters": [{"name": "x", "parameterType": "double", "feasibleSpace": {"min": "0", "max": "1"}}],
             "trialTemplate": {"primaryContainerName": "main", "trialParameters": [{"name": "x", "reference": "x"}],
                               "trialSpec": {"apiVersion": "batch/v1", "kind": "Job", "spec": {"template": {"spec": {
                                   "containers": [{"name": "main", "image": "python:3.11",
                                                   "command": ["python", "train.py", "--x=${trialParameters.x}"]}]}}}}}}})


class RunningJobs(TrialJobs):
    """Jobs that run until cancelled, writing a line every 20 ms (so a follower that has let go stops)."""

    def __init__(self) -> None:
        self.states: dict[str, str] = {}
        self.cancelled: list[str] = []
        self.running = threading.Semaphore(0)

    def ensure(self, spec: jobs_pb2.JobSpec) -> JobView:
        if spec.name not in self.states:
            self.states[spec.name] = "running"
            self.running.release()
        return self.get(spec.name)

    def get(self, job_id: str) -> JobView:
        return JobView(job_id, self.states[job_id])

    def cancel(self, job_id: str) -> JobView:
        if self.states.get(job_id) == "running":
            self.states[job_id] = "cancelled"
            self.cancelled.append(job_id)
        return self.get(job_id)

    def follow(self, job_id: str) -> Iterator[str]:
        while self.states[job_id] == "running":
            time.sleep(0.02)
            yield "training\n"


@pytest.fixture
async def store():
    client = aioredis.from_url(REDIS)
    prefix = f"opml-test:automl-{uuid.uuid4().hex[:8]}:"
    yield ExperimentStore(client, prefix=prefix)
    keys = [k async for k in client.scan_iter(match=prefix + "*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def test_the_controller_and_its_store_start_once_and_stop_once(store: ExperimentStore) -> None:
    await store.put_experiment(ExperimentRecord(name="held", uid="aa", katib_yaml=EXPERIMENT, max_trial_count=4),
                               new=True)
    jobs = RunningJobs()
    ctl = Controller(store=store, jobs=jobs, emitter=RecordingEmitter(), redis_url=REDIS, retry_s=0.05)
    await ctl.stop()  # never started: nothing to stop
    async with store, ctl:
        assert store.running and ctl.running
        [run] = ctl._runs.values()  # the stored experiment, run again
        for _ in range(2):
            await asyncio.to_thread(jobs.running.acquire)  # its two trials' jobs running
        await ctl.start()
        await store.start()
        assert list(ctl._runs.values()) == [run], "a second start launched nothing"
    assert not ctl.running and not store.running and run.done()
    await ctl.stop()
    assert jobs.cancelled == [] and sorted(jobs.states.values()) == ["running", "running"], \
        "the trials' jobs go on, re-attached at the next start"

    again = Controller(store=store, jobs=jobs, emitter=RecordingEmitter(), redis_url=REDIS, retry_s=0.05)
    async with again:  # re-attaches: no job submitted twice
        await asyncio.sleep(0.3)
        assert len(jobs.states) == 2


async def test_stopping_cancels_again_a_task_that_swallowed_its_cancel_and_logs_a_failure(
        caplog: pytest.LogCaptureFixture) -> None:
    swallowed = asyncio.Event()

    async def swallows_once() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:  # as a Redis call's timeout can take the cancel for its own
            swallowed.set()
        await asyncio.sleep(60)

    async def fails() -> None:
        raise RuntimeError("Redis went away")

    tasks = [asyncio.create_task(swallows_once(), name="swallows"), asyncio.create_task(fails(), name="fails")]
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger=controller_module.__name__):
        await asyncio.wait_for(controller_module._cancel(tasks), 5)
    assert swallowed.is_set() and tasks[0].cancelled()
    assert "fails ended with an error" in caplog.text and "Redis went away" in caplog.text
