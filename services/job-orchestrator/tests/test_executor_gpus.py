"""GPU jobs on this machine: the local executor hands each GPU task devices of its own
(CUDA_VISIBLE_DEVICES, taken back when the run ends), and the scheduler over this machine's node
queues a GPU job while the devices are held and refuses one a machine without GPUs can never run.

The devices are given to the executor and to :func:`this_machine` (what nvidia-smi would list on a
GPU machine); the tasks are real processes that report what they were given.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import pytest

from opml_common.errors import InvalidArgument
from opml_common.gpus import GpuDevice
from opml_devstack.testing.bus import wait_until
from opml_job_orchestrator.executor import JobOutcome, JobProgram, LocalExecutor
from opml_job_orchestrator.scheduler import (
    Cluster,
    JobClass,
    JobSpec,
    NodeSpec,
    Resources,
    RoleSpec,
    Scheduler,
    StartJob,
    te_be_plus_policy,
)
from opml_job_orchestrator.settings import this_machine

CARDS = [GpuDevice(0, "NVIDIA H100 80GB HBM3", 81559), GpuDevice(1, "NVIDIA H100 80GB HBM3", 81559),
         GpuDevice(2, "NVIDIA A10", 23028)]


def job(job_id: str, gpu: int, replicas: int = 1) -> JobSpec:
    return JobSpec(job_id=job_id, job_class=JobClass.BE,
                   roles={"worker": RoleSpec(replicas, Resources(cpu_millis=100, memory_mib=64, gpu=gpu))})


def placement(spec: JobSpec) -> Mapping[str, tuple[str, ...]]:
    return {role: ("local",) * role_spec.replicas for role, role_spec in spec.roles.items()}


def reporting(out: Path, *, until: Path | None = None) -> list[str]:
    """A task that writes the CUDA_VISIBLE_DEVICES it was given to ``out/<job>-<index>.json``, then
    waits for ``until`` to exist (never, when None)."""
    code = ("import json, os, pathlib, time; t = json.loads(os.environ['TF_CONFIG'])['task']; "
            f"pathlib.Path({str(out)!r}, os.environ['OPML_JOB_ID'] + '-' + str(t['index']) + '.json').write_text("
            "json.dumps(os.environ.get('CUDA_VISIBLE_DEVICES')))")
    if until is not None:
        code += f"\nwhile not pathlib.Path({str(until)!r}).exists(): time.sleep(0.02)"
    return [sys.executable, "-c", code]


@pytest.fixture
async def executor(tmp_path: Path) -> AsyncIterator[LocalExecutor]:
    async with LocalExecutor(work_dir=tmp_path / "work", heartbeat_check_interval_s=0.1, cleanup_grace_s=1.0,
                             shutdown_grace_s=0.5, devices=CARDS) as ex:
        yield ex


async def test_gpu_tasks_get_devices_of_their_own_until_their_run_ends(
        executor: LocalExecutor, job_dir: Path, until_job_event, job_event) -> None:
    go = job_dir / "go"
    train = job("train", gpu=1, replicas=2)
    # The job's own env cannot give it devices: the executor's choice wins.
    await executor.launch(train, JobProgram(commands={"worker": reporting(job_dir, until=go)},
                                            env={"CUDA_VISIBLE_DEVICES": "0,1,2"}), placement(train), attempt=1)
    files = [job_dir / "train-0.json", job_dir / "train-1.json"]
    await wait_until(lambda: all(f.exists() for f in files), what="both workers wrote their devices")
    given = sorted(json.loads(f.read_text()) for f in files)
    assert given == ["0", "1"]
    assert executor.devices.free == (CARDS[2],)

    # Two more are not free while train runs: the task cannot start and the run fails saying so.
    big = job("big", gpu=2)
    await executor.launch(big, JobProgram(commands={"worker": reporting(job_dir)}), placement(big), attempt=1)
    event = job_event(await until_job_event(executor, "big"))
    assert event.outcome is JobOutcome.FAILED
    assert "worker 0 needs 2 GPUs, but 1 of this machine's 3 are free" in event.message
    assert executor.devices.free == (CARDS[2],)

    go.touch()
    assert job_event(await until_job_event(executor, "train")).outcome is JobOutcome.SUCCEEDED
    assert executor.devices.free == tuple(CARDS)

    # A task that asks for none sees none, even while devices are free.
    cpu = job("cpu", gpu=0)
    await executor.launch(cpu, JobProgram(commands={"worker": reporting(job_dir)}), placement(cpu), attempt=1)
    assert job_event(await until_job_event(executor, "cpu")).outcome is JobOutcome.SUCCEEDED
    assert json.loads((job_dir / "cpu-0.json").read_text()) == ""


def scheduler_of_this_machine(devices: list[GpuDevice]) -> Scheduler:
    nodes = [NodeSpec(n.name, Resources(n.cpu_millis, n.memory_mib, n.gpu)) for n in this_machine(devices)]
    return Scheduler(Cluster(nodes), te_be_plus_policy())


def test_a_machine_without_gpus_refuses_a_gpu_job_at_admission() -> None:
    assert this_machine([])[0].gpu == 0
    with pytest.raises(InvalidArgument, match=r"is 1 per replica, but the largest node has 0") as refused:
        scheduler_of_this_machine([]).submit(job("gpu-job", gpu=1), now=0)
    assert refused.value.field == "roles.worker.resources.gpu"


def test_this_machine_queues_gpu_jobs_while_its_devices_are_held() -> None:
    assert this_machine(CARDS[:2])[0].gpu == 2
    scheduler = scheduler_of_this_machine(CARDS[:2])
    scheduler.submit(job("a", gpu=2), now=0)
    scheduler.submit(job("b", gpu=1), now=0)
    assert [d.job_id for d in scheduler.schedule(now=0) if isinstance(d, StartJob)] == ["a"]
    scheduler.finish("a", now=1)
    assert [d.job_id for d in scheduler.schedule(now=1) if isinstance(d, StartJob)] == ["b"]
