"""The local executor with real processes: TF_CONFIG, env, logs, stop with grace, TonY-style
completion, start failures, heartbeats and checkpoint reports, recovery after a crash, tracing;
and the retry policy.

Tasks are small ``python -c`` scripts. The ``executor`` fixture stops the executor at the end of
every test, which kills every task still running, failed test or not. It sandboxes tasks where the
tests run as root (CI does), as the service does: what a task writes for the test to read goes in
``job_dir``, which the task's own user may write (``test_sandbox.py`` covers the sandbox itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import psutil
import pytest

from opml_common.bus import ensure_topics
from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound
from opml_devstack.testing.bus import poll_until, wait_until
from opml_job_orchestrator.executor import (
    CheckpointEvent,
    JobEvent,
    JobOutcome,
    JobProgram,
    LocalExecutor,
    RetryPolicy,
    TaskEvent,
    TaskState,
    local,
    tony,
)
from opml_job_orchestrator.scheduler import JobClass, JobSpec, Resources, RoleSpec
from opml_trace_collector_contract.topics import TRACES

CPU = Resources(cpu_millis=100)
SLEEP = "import time; time.sleep(30)"


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def spec(job_id: str = "job", **replicas: int) -> JobSpec:
    return JobSpec(job_id=job_id, job_class=JobClass.BE,
                   roles={role: RoleSpec(n, CPU) for role, n in (replicas or {"worker": 1}).items()})


def placement(job: JobSpec) -> Mapping[str, tuple[str, ...]]:
    return {role: ("local",) * role_spec.replicas for role, role_spec in job.roles.items()}


@pytest.fixture
async def executor(tmp_path: Path) -> AsyncIterator[LocalExecutor]:
    async with LocalExecutor(work_dir=tmp_path / "work", heartbeat_check_interval_s=0.1,
                             cleanup_grace_s=1.0, shutdown_grace_s=0.5) as ex:
        yield ex


async def test_tf_config_and_env_for_chief_workers_ps_evaluator(
        executor: LocalExecutor, job_dir: Path, until_job_event, job_event) -> None:
    out = job_dir
    dump = ("import json, os, pathlib; t = json.loads(os.environ['TF_CONFIG'])['task']; "
            f"pathlib.Path({str(out)!r}, f\"{{t['type']}}-{{t['index']}}.json\").write_text(json.dumps("
            "{k: os.environ.get(k) for k in ('TF_CONFIG', 'OPML_JOB_ATTEMPT', 'OPML_CHECKPOINT_DIR', 'OPML_JOB_ID', "
            "'EXTRA')}))")
    # the chief ends the run, which stops the others: it waits until every task wrote its file
    chief = dump + f"\nimport time\nwhile len(list(pathlib.Path({str(out)!r}).glob('*.json'))) < 5: time.sleep(0.02)"
    job = spec("tf", chief=1, worker=2, ps=1, evaluator=1)
    program = JobProgram(commands={**dict.fromkeys(("worker", "ps", "evaluator"), py(dump)), "chief": py(chief)},
                         env={"EXTRA": "x"}, checkpoint_dir=str(job_dir / "ckpt"))
    await executor.launch(job, program, placement(job), attempt=2)
    event = job_event(await until_job_event(executor, "tf"))
    assert event.outcome is JobOutcome.SUCCEEDED

    seen = {}
    for role, index in [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0), ("evaluator", 0)]:
        env = json.loads((out / f"{role}-{index}.json").read_text())
        assert env["OPML_JOB_ATTEMPT"] == "2"
        assert env["OPML_CHECKPOINT_DIR"] == str(job_dir / "ckpt")
        assert env["OPML_JOB_ID"] == "tf" and env["EXTRA"] == "x"
        tf_config = json.loads(env["TF_CONFIG"])
        assert tf_config["task"] == {"type": role, "index": index}
        seen[(role, index)] = tf_config["cluster"]
    cluster = seen[("chief", 0)]
    assert all(c == cluster for c in seen.values())
    assert sorted(cluster) == ["chief", "ps", "worker"]  # no evaluator, as TensorFlow requires
    assert [len(cluster[r]) for r in ("chief", "worker", "ps")] == [1, 2, 1]
    addresses = [a for role in cluster.values() for a in role]
    assert len(set(addresses)) == 4 and all(a.startswith("127.0.0.1:") for a in addresses)


async def test_each_cluster_port_is_kept_for_its_task_until_the_run_ends(
        executor: LocalExecutor, job_dir: Path, until_job_event, job_event) -> None:
    """Between launch and the task's own bind (seconds of importing TensorFlow), nothing else may take
    its port: a plain bind is refused, while a server that binds as gRPC's do (SO_REUSEADDR) gets it
    and listens; once the run ended, the port is free."""
    report = job_dir / "report.json"
    task = ("import errno, json, os, socket; t = json.loads(os.environ['TF_CONFIG']); "
            "port = int(t['cluster']['worker'][t['task']['index']].rsplit(':', 1)[1]); out = {'port': port}\n"
            "with socket.socket() as plain:\n"
            "    try: plain.bind(('127.0.0.1', port)); out['plain'] = 'bound'\n"
            "    except OSError as exc: out['plain'] = errno.errorcode[exc.errno]\n"
            "with socket.socket() as server:\n"
            "    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            "    server.bind(('0.0.0.0', port)); server.listen(); out['server'] = 'listening'\n"
            f"open({str(report)!r}, 'w').write(json.dumps(out))")
    job = spec("ports", worker=1)
    await executor.launch(job, JobProgram(commands={"worker": py(task)}), placement(job), attempt=0)
    assert job_event(await until_job_event(executor, "ports")).outcome is JobOutcome.SUCCEEDED
    seen = json.loads(report.read_text())
    assert (seen["plain"], seen["server"]) == ("EADDRINUSE", "listening")
    with socket.socket() as after:
        after.bind(("127.0.0.1", seen["port"]))


async def test_logs_are_captured_per_task(executor: LocalExecutor, until_job_event, job_event) -> None:
    job = spec("logs", worker=2)
    code = ("import os, sys; i = os.environ['OPML_TASK_INDEX']; print('out', i, flush=True); "
            "print('err', i, file=sys.stderr)")
    await executor.launch(job, JobProgram(commands={"worker": py(code)}), placement(job), attempt=0)
    assert job_event(await until_job_event(executor, "logs")).outcome is JobOutcome.SUCCEEDED
    for i in (0, 1):
        text = await executor.logs("logs", "worker", i)
        assert f"out {i}" in text and f"err {i}" in text
    with pytest.raises(NotFound, match="no task 'worker' 2"):
        await executor.logs("logs", "worker", 2)
    with pytest.raises(NotFound, match="no attempt 1"):
        await executor.logs("logs", "worker", 0, attempt=1)
    with pytest.raises(NotFound, match="never launched"):
        await executor.logs("nope", "worker", 0)


async def test_terminate_sends_sigterm_so_a_task_can_checkpoint(
        executor: LocalExecutor, job_dir: Path, until_job_event, job_event, task_states) -> None:
    ckpt = job_dir / "ckpt"  # made for the job
    code = ("import os, pathlib, signal, sys, time\n"
            "def save(*_):\n"
            "    pathlib.Path(os.environ['OPML_CHECKPOINT_DIR'], 'model.ckpt').write_text('step 7')\n"
            "    sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, save)\n"
            "print('ready', flush=True)\n"
            "time.sleep(30)\n")
    job = spec("be")
    await executor.launch(job, JobProgram(commands={"worker": py(code)}, checkpoint_dir=str(ckpt)),
                          placement(job), attempt=0)
    while "ready" not in await executor.logs("be", "worker", 0):
        await asyncio.sleep(0.02)
    grace_s = 60.0  # the task exits on SIGTERM at once: terminate must return then, not at the end of the grace
    started = time.monotonic()
    await executor.terminate("be", grace_s=grace_s)
    assert time.monotonic() - started < grace_s / 2  # relative to the grace, not to the machine's speed
    assert (ckpt / "model.ckpt").read_text() == "step 7"
    events = await until_job_event(executor, "be")
    assert task_states(events)[("worker", 0)] == [TaskState.RUNNING, TaskState.STOPPED]
    assert [e.exit_code for e in events if isinstance(e, TaskEvent) and e.state is TaskState.STOPPED] == [0]
    assert job_event(events).outcome is JobOutcome.STOPPED
    await executor.terminate("be", grace_s=0)  # already ended: nothing to do


async def test_terminate_kills_a_task_that_ignores_sigterm_and_its_children(
        executor: LocalExecutor, job_dir: Path, until_job_event, alive) -> None:
    child_pid = job_dir / "child.pid"
    code = ("import signal, subprocess, sys, time, pathlib\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            f"child = subprocess.Popen([sys.executable, '-c', {SLEEP!r}])\n"
            f"pathlib.Path({str(child_pid)!r}).write_text(str(child.pid))\n"
            "print('ready', flush=True)\n"
            "time.sleep(30)\n")
    job = spec("stubborn")
    await executor.launch(job, JobProgram(commands={"worker": py(code)}), placement(job), attempt=0)
    while "ready" not in await executor.logs("stubborn", "worker", 0):
        await asyncio.sleep(0.02)
    started = time.monotonic()
    await executor.terminate("stubborn", grace_s=0.5)
    assert time.monotonic() - started >= 0.5  # it waited the grace (a lower bound: the clock never runs fast)
    events = await until_job_event(executor, "stubborn")
    (stopped,) = [e for e in events if isinstance(e, TaskEvent) and e.state is TaskState.STOPPED]
    assert stopped.exit_code == -9 and "SIGKILL" in stopped.message
    pid = int(child_pid.read_text())
    for _ in range(50):
        if not alive(pid):
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError(f"child {pid} of the killed task still runs")


async def test_job_succeeds_when_chief_exits_without_awaiting_ps(
        executor: LocalExecutor, until_job_event, job_event, task_states) -> None:
    job = spec("tony", chief=1, worker=1, ps=2)
    forever = "import time; time.sleep(3600)"  # ends only when stopped: the run's end shows they were not awaited
    program = JobProgram(commands={"chief": py("import time; time.sleep(0.2)"), "worker": py(forever),
                                   "ps": py(forever)})
    await executor.launch(job, program, placement(job), attempt=0)
    events = await until_job_event(executor, "tony", timeout_s=60.0)  # a bound on failure only
    assert job_event(events).outcome is JobOutcome.SUCCEEDED
    states = task_states(events)
    assert states[("chief", 0)] == [TaskState.RUNNING, TaskState.SUCCEEDED]
    for key in [("worker", 0), ("ps", 0), ("ps", 1)]:
        assert states[key] == [TaskState.RUNNING, TaskState.STOPPED]
    assert isinstance(events[-1], JobEvent)  # task events come first


async def test_a_failing_task_fails_the_run_and_stops_the_others(
        executor: LocalExecutor, until_job_event, job_event, task_states) -> None:
    job = spec("crash", worker=2)
    code = "import os, sys, time; i = int(os.environ['OPML_TASK_INDEX']); time.sleep(30 * (1 - i)); sys.exit(3)"
    await executor.launch(job, JobProgram(commands={"worker": py(code)}), placement(job), attempt=0)
    events = await until_job_event(executor, "crash")
    event = job_event(events)
    assert event.outcome is JobOutcome.FAILED and event.retriable
    assert event.message == "worker 1 exited with code 3"
    assert task_states(events)[("worker", 0)] == [TaskState.RUNNING, TaskState.STOPPED]


async def test_nonexistent_command_fails_with_the_os_error(
        executor: LocalExecutor, until_job_event, job_event, task_states) -> None:
    job = spec("typo", chief=1, worker=1, ps=1)
    program = JobProgram(commands={"chief": py(SLEEP), "worker": ["nosuchcmd", "--x"], "ps": py(SLEEP)})
    await executor.launch(job, program,
                          placement(job), attempt=0)
    events = await until_job_event(executor, "typo")
    (failed,) = [e for e in events if isinstance(e, TaskEvent) and e.state is TaskState.FAILED]
    assert failed.role == "worker" and "No such file or directory: 'nosuchcmd'" in failed.message
    event = job_event(events)
    assert event.outcome is JobOutcome.FAILED and not event.retriable
    assert "No such file or directory: 'nosuchcmd'" in event.message
    states = task_states(events)
    assert states[("chief", 0)] == [TaskState.RUNNING, TaskState.STOPPED]  # started before the worker failed
    assert ("ps", 0) not in states  # never started


async def test_stale_heartbeat_makes_the_task_lost(
        executor: LocalExecutor, until_job_event, job_event, task_states) -> None:
    job = spec("hb", worker=2)
    beat = ("import os, pathlib, time\n"
            "i = int(os.environ['OPML_TASK_INDEX'])\n"
            "for _ in range(300):\n"
            "    if i == 0: pathlib.Path(os.environ['OPML_HEARTBEAT_FILE']).touch()\n"
            "    time.sleep(0.1)\n")
    await executor.launch(job, JobProgram(commands={"worker": py(beat)}, heartbeat_timeout_s=0.5),
                          placement(job), attempt=1)
    events = await until_job_event(executor, "hb")
    states = task_states(events)
    assert states[("worker", 1)] == [TaskState.RUNNING, TaskState.LOST]
    assert states[("worker", 0)] == [TaskState.RUNNING, TaskState.STOPPED]
    event = job_event(events)
    assert event.outcome is JobOutcome.FAILED and event.retriable and event.attempt == 1
    assert "worker 1 sent no heartbeat" in event.message


async def test_relaunch_after_a_run_ends_with_the_next_attempt(
        executor: LocalExecutor, until_job_event, job_event) -> None:
    job = spec("again")
    program = JobProgram(commands={"worker": py("import os; print('attempt', os.environ['OPML_JOB_ATTEMPT'])")})
    await executor.launch(job, program, placement(job), attempt=0)
    await until_job_event(executor, "again")
    await executor.launch(job, program, placement(job), attempt=1)
    assert job_event(await until_job_event(executor, "again")).attempt == 1
    assert "attempt 1" in await executor.logs("again", "worker", 0)
    assert "attempt 0" in await executor.logs("again", "worker", 0, attempt=0)


async def test_launch_and_terminate_errors(executor: LocalExecutor, tmp_path: Path) -> None:
    job = spec("bad", chief=1, worker=2)
    program = JobProgram(commands={"chief": py(SLEEP), "worker": py(SLEEP)})
    with pytest.raises(InvalidArgument, match=r"^commands.worker: .*has no entry"):
        await executor.launch(job, JobProgram(commands={"chief": py(SLEEP)}), placement(job), attempt=0)
    with pytest.raises(InvalidArgument, match=r"^placement.worker: .*one node per replica \(2\), but got \('a',\)"):
        await executor.launch(job, program, {"chief": ("a",), "worker": ("a",)}, attempt=0)
    with pytest.raises(InvalidArgument, match=r"^placement: "):
        await executor.launch(job, program, {"chief": ("a",)}, attempt=0)
    with pytest.raises(InvalidArgument, match=r"^attempt: .* but got -1"):
        await executor.launch(job, program, placement(job), attempt=-1)
    await executor.launch(job, program, placement(job), attempt=0)
    with pytest.raises(FailedPrecondition, match="still runs attempt 0"):
        await executor.launch(job, program, placement(job), attempt=1)
    with pytest.raises(InvalidArgument, match=r"^grace_s: .* but got -1"):
        await executor.terminate("bad", grace_s=-1)
    with pytest.raises(NotFound, match="'other' was never launched"):
        await executor.terminate("other", grace_s=1)
    with pytest.raises(InvalidArgument, match=r"^timeout_s: "):
        await executor.poll(float("nan"))
    not_started = LocalExecutor(work_dir=tmp_path / "w2")
    with pytest.raises(FailedPrecondition, match="not started"):
        await not_started.launch(job, program, placement(job), attempt=0)


async def test_stop_terminates_running_jobs_and_is_idempotent(tmp_path: Path, job_event, task_states) -> None:
    ex = LocalExecutor(work_dir=tmp_path / "work", shutdown_grace_s=0.5)
    await ex.start()
    await ex.start()
    job = spec("long")
    await ex.launch(job, JobProgram(commands={"worker": py(SLEEP)}), placement(job), attempt=0)
    await ex.stop()
    await ex.stop()
    events = await ex.poll(0)
    assert job_event(events).outcome is JobOutcome.STOPPED
    assert task_states(events)[("worker", 0)] == [TaskState.RUNNING, TaskState.STOPPED]


def test_program_and_settings_are_checked() -> None:
    with pytest.raises(InvalidArgument, match=r"^commands.trainer: role 'trainer' is not one of"):
        JobProgram(commands={"trainer": ["x"]})
    with pytest.raises(InvalidArgument, match=r"^commands.worker: .*non-empty list of strings.*but got 'python x.py'"):
        JobProgram(commands={"worker": "python x.py"})
    with pytest.raises(InvalidArgument, match=r"^heartbeat_timeout_s: .*> 0, or None for no heartbeat, but got 0"):
        JobProgram(commands={"worker": ["x"]}, heartbeat_timeout_s=0)
    with pytest.raises(InvalidArgument, match=r"^env: "):
        JobProgram(commands={"worker": ["x"]}, env={"A": 1})
    with pytest.raises(InvalidArgument, match=r"^cleanup_grace_s: .*>= 0, but got -1"):
        LocalExecutor(work_dir="w", cleanup_grace_s=-1)
    with pytest.raises(InvalidArgument, match=r"^heartbeat_check_interval_s: .*> 0, but got 0"):
        LocalExecutor(work_dir="w", heartbeat_check_interval_s=0)


def test_retry_policy_backs_off_exponentially_up_to_the_cap_and_the_limit() -> None:
    policy = RetryPolicy(max_retries=5, base_delay_s=1.0, max_delay_s=10.0)
    assert [policy.next_delay(n) for n in range(7)] == [1.0, 2.0, 4.0, 8.0, 10.0, None, None]
    assert policy.next_delay(0, retriable=False) is None
    assert RetryPolicy(max_retries=0, base_delay_s=1, max_delay_s=1).next_delay(0) is None
    assert RetryPolicy(max_retries=3, base_delay_s=0, max_delay_s=0).next_delay(2) == 0.0
    assert RetryPolicy(max_retries=10**6, base_delay_s=1, max_delay_s=60).next_delay(10**5) == 60.0
    assert RetryPolicy(max_retries=3, base_delay_s=2, max_delay_s=100, multiplier=3).next_delay(2) == 18.0


def test_retry_policy_checks_its_settings() -> None:
    with pytest.raises(InvalidArgument, match=r"^max_retries: .* but got -1"):
        RetryPolicy(max_retries=-1, base_delay_s=1, max_delay_s=1)
    with pytest.raises(InvalidArgument, match=r"^max_delay_s: .*>= `base_delay_s` \(5\), but got 1"):
        RetryPolicy(max_retries=1, base_delay_s=5, max_delay_s=1)
    with pytest.raises(InvalidArgument, match=r"^multiplier: "):
        RetryPolicy(max_retries=1, base_delay_s=1, max_delay_s=1, multiplier=0.5)
    with pytest.raises(InvalidArgument, match=r"^retries_done: "):
        RetryPolicy(max_retries=1, base_delay_s=1, max_delay_s=1).next_delay(-1)


async def test_checkpoint_reports_become_events_once_per_step_and_count_as_heartbeats(
        executor: LocalExecutor, until_job_event, job_event) -> None:
    # both workers report steps 5 and 10 (10 right before exiting), with touches and non-JSON between
    code = ("import json, os, pathlib, time\n"
            "beat = pathlib.Path(os.environ['OPML_HEARTBEAT_FILE'])\n"
            "def report(step):\n"
            "    beat.with_suffix('.tmp').write_text(json.dumps({'checkpoint_step': step}))\n"
            "    os.replace(beat.with_suffix('.tmp'), beat)\n"
            "report(5); time.sleep(0.3)\n"
            "beat.touch(); time.sleep(0.3)\n"
            "report(5); time.sleep(0.3)\n"
            "beat.write_text('alive'); time.sleep(0.3)\n"
            "report(10)\n")
    job = spec("ckpt", worker=2)
    await executor.launch(job, JobProgram(commands={"worker": py(code)}, heartbeat_timeout_s=0.8),
                          placement(job), attempt=3)
    events = await until_job_event(executor, "ckpt")
    assert job_event(events).outcome is JobOutcome.SUCCEEDED  # JSON writes and touches kept it alive
    checkpoints = [e for e in events if isinstance(e, CheckpointEvent)]
    assert [(e.job_id, e.attempt, e.step) for e in checkpoints] == [("ckpt", 3, 5), ("ckpt", 3, 10)]
    assert all(abs(e.at - time.time()) < 10 for e in checkpoints)
    assert events.index(checkpoints[-1]) < events.index(job_event(events))


async def test_every_task_gets_a_heartbeat_file_even_without_a_timeout(
        executor: LocalExecutor, until_job_event) -> None:
    job = spec("plain")
    code = "import json, os; open(os.environ['OPML_HEARTBEAT_FILE'], 'w').write(json.dumps({'checkpoint_step': 1}))"
    await executor.launch(job, JobProgram(commands={"worker": py(code)}), placement(job), attempt=0)
    events = await until_job_event(executor, "plain")
    assert [e.step for e in events if isinstance(e, CheckpointEvent)] == [1]


ORPHANING_LAUNCHER = """
import asyncio, os, sys
from opml_job_orchestrator.executor import JobProgram, LocalExecutor
from opml_job_orchestrator.scheduler import JobClass, JobSpec, Resources, RoleSpec

work, out = sys.argv[1], sys.argv[2]
task = '''
import os, pathlib, signal, subprocess, sys, time
out = pathlib.Path(sys.argv[1]); i = os.environ['OPML_TASK_INDEX']
def on_term(*_):
    (out / f'term-{i}').write_text('checkpointed')
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
(out / f'pids-{i}').write_text(f'{os.getpid()} {child.pid}')
print('ready', i, flush=True)
time.sleep(60)
'''

async def main():
    ex = LocalExecutor(work_dir=work)
    await ex.start()
    job = JobSpec(job_id="orphan", job_class=JobClass.BE,
                  roles={"worker": RoleSpec(2, Resources(cpu_millis=100))})
    await ex.launch(job, JobProgram(commands={"worker": [sys.executable, "-c", task, out]}),
                    {"worker": ("local", "local")}, attempt=0)
    while len(list(os.scandir(out))) < 2:
        await asyncio.sleep(0.02)
    os._exit(0)  # the orchestrator crashes: its tasks are left running

asyncio.run(main())
"""


async def test_recover_stops_what_a_crashed_executor_left_running(
        tmp_path: Path, job_dir: Path, until_job_event, job_event, task_states, alive) -> None:
    work, out = tmp_path / "work", job_dir
    crashed = await asyncio.create_subprocess_exec(sys.executable, "-c", ORPHANING_LAUNCHER, str(work), str(out))
    assert await asyncio.wait_for(crashed.wait(), 30) == 0
    pids = [int(p) for i in (0, 1) for p in (out / f"pids-{i}").read_text().split()]
    try:
        assert all(map(alive, pids))
        async with LocalExecutor(work_dir=work, shutdown_grace_s=2.0) as ex:
            assert "ready 1" in await ex.logs("orphan", "worker", 1)  # logs of the previous executor
            await ex.recover("orphan", 0)
            assert not any(map(alive, pids))  # tasks and their children
            assert [(out / f"term-{i}").read_text() for i in (0, 1)] == ["checkpointed"] * 2  # SIGTERM came first
            events = await ex.poll(0)
            assert task_states(events) == {("worker", 0): [TaskState.STOPPED], ("worker", 1): [TaskState.STOPPED]}
            event = job_event(events)
            assert (event.outcome, event.attempt, event.retriable) == (JobOutcome.STOPPED, 0, True)
            assert "2 task(s) left running were stopped" in event.message
            await ex.recover("orphan", 0)  # already recovered: nothing to do
            assert await ex.poll(0) == []
            await ex.terminate("orphan", 0)  # already ended
            job = spec("orphan")
            await ex.launch(job, JobProgram(commands={"worker": py("print('again')")}), placement(job), attempt=1)
            assert job_event(await until_job_event(ex, "orphan")).outcome is JobOutcome.SUCCEEDED
            assert "again" in await ex.logs("orphan", "worker", 0)
            assert "ready 0" in await ex.logs("orphan", "worker", 0, attempt=0)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def test_recover_never_signals_a_reused_pid(executor: LocalExecutor, tmp_path: Path, job_event, alive) -> None:
    stranger = await asyncio.create_subprocess_exec(sys.executable, "-c", SLEEP, start_new_session=True)
    try:
        run_dir = tmp_path / "work" / "reused" / "attempt-2"
        run_dir.mkdir(parents=True)
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        start_ticks = int(Path(f"/proc/{stranger.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        (run_dir / "run.json").write_text(json.dumps({"boot_id": boot_id, "tasks": [
            {"role": "worker", "index": 0, "pid": stranger.pid, "start_ticks": start_ticks - 1,
             "log": str(run_dir / "worker-0.log")}]}))
        await executor.recover("reused", 2)
        assert alive(stranger.pid)
        event = job_event(await executor.poll(0))
        assert event.retriable and "no task of the run was left running" in event.message
        await executor.recover("never-ran", 0)  # no manifest at all: nothing left either
        assert job_event(await executor.poll(0)).outcome is JobOutcome.STOPPED
        with pytest.raises(InvalidArgument, match=r"^attempt: "):
            await executor.recover("reused", -1)
    finally:
        stranger.kill()
        await stranger.wait()


def test_trace_wraps_each_task_in_the_trace_launcher() -> None:
    program = JobProgram(commands={"worker": ["python", "train.py", "--epochs", "2"]}, trace=True)
    assert tony.task_argv(program, job_id="j1", role="worker", index=1, python="/venv/bin/python") == [
        "/venv/bin/python", "-m", "opml_trace_collector.inject.run", "--job", "j1", "--worker", "worker-1", "--",
        "python", "train.py", "--epochs", "2"]
    assert tony.task_argv(program, job_id="j1", role="worker", index=1, python="py", shipped=True)[:4] == [
        "py", "-m", "opml_trace_collector.inject.run", "--no-shipper"]  # the executor runs the host's shipper
    untraced = JobProgram(commands={"worker": ["python", "train.py"]})
    assert tony.task_argv(untraced, job_id="j1", role="worker", index=0, python="py") == ["python", "train.py"]
    with pytest.raises(InvalidArgument, match=r"^trace: "):
        JobProgram(commands={"worker": ["x"]}, trace="yes")


async def test_traced_job_fails_without_retry_when_the_launcher_is_missing(
        executor: LocalExecutor, monkeypatch: pytest.MonkeyPatch, until_job_event, job_event, task_states) -> None:
    monkeypatch.setattr(tony, "TRACE_LAUNCHER", "opml_no_such_package.inject.run")
    job = spec("traced", worker=2)
    await executor.launch(job, JobProgram(commands={"worker": py("pass")}, trace=True), placement(job), attempt=0)
    events = await until_job_event(executor, "traced")
    event = job_event(events)
    assert event.outcome is JobOutcome.FAILED and not event.retriable
    assert "'opml_no_such_package.inject.run' is not installed" in event.message
    assert task_states(events) == {("worker", 0): [TaskState.FAILED]}


async def test_traced_job_runs_under_the_launcher_unchanged_and_the_executor_owns_the_shipper(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, until_job_event, job_event) -> None:
    """Stand-in launcher and shipper modules (the trace-collector's command lines): the launcher records
    how it was called and runs the job's argv, which sees its usual environment; the shipper, started by
    the executor with the platform's variables for the job's tracer, lives until the executor stops.
    Unsandboxed, where jobs share the platform's spool and one shipper (``test_sandbox.py`` has the
    sandboxed runs' own spools and shippers)."""
    package = tmp_path / "lib" / "fake_tracer"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "run.py").write_text(
        "import os, sys\n"
        "split = sys.argv.index('--')\n"
        "print('launcher', sys.argv[1:split], flush=True)\n"
        "os.execvp(sys.argv[split + 1], sys.argv[split + 1:])\n")
    pid_file = tmp_path / "shipper.pid"
    (package / "ship.py").write_text(
        "import os, pathlib, time\n"
        f"pathlib.Path({str(pid_file)!r}).write_text(f\"{{os.getpid()}} {{os.environ['OPML_TOPIC_PREFIX']}} "
        "{os.environ['OPML_TRACE_SPOOL_DIR']}\")\n"
        "time.sleep(300)\n")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))  # the executor checks the launcher is installed
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "lib"))  # what the tasks and the shipper inherit here
    monkeypatch.setattr(tony, "INHERITED_VARIABLES", tony.INHERITED_VARIABLES | {"PYTHONPATH"})
    monkeypatch.setattr(tony, "TRACE_LAUNCHER", "fake_tracer.run")
    monkeypatch.setattr(local, "TRACE_SHIPPER", "fake_tracer.ship")
    job = spec("traced", worker=1)
    program = JobProgram(commands={"worker": py("import os; print('job sees', os.environ['OPML_TASK_TYPE'], "
                                                "os.environ['OPML_TRACE_SPOOL_DIR'])")},
                         trace=True)
    spool = tmp_path / "spool"  # the executor's, not the tracer's default in the home directory
    async with LocalExecutor(work_dir=tmp_path / "work", shutdown_grace_s=0.5, trace_spool_dir=spool,
                             platform_env={"OPML_TOPIC_PREFIX": "platform-"}, sandbox="off") as executor:
        await executor.launch(job, program, placement(job), attempt=0)
        assert job_event(await until_job_event(executor, "traced")).outcome is JobOutcome.SUCCEEDED
        log = await executor.logs("traced", "worker", 0)
        assert "launcher ['--no-shipper', '--job', 'traced', '--worker', 'worker-0']" in log
        assert f"job sees worker {spool}" in log
        await executor.launch(spec("again", worker=1), program, placement(spec("again", worker=1)), attempt=0)
        assert job_event(await until_job_event(executor, "again")).outcome is JobOutcome.SUCCEEDED
        poll_until(lambda: pid_file.exists() and " " in pid_file.read_text(), timeout_s=60, what="the shipper started")
        pid, prefix, shipped = pid_file.read_text().split()
        assert (prefix, shipped) == ("platform-", str(spool))  # it publishes where the job's tracer was told to
        shippers = [child for child in psutil.Process().children() if "fake_tracer.ship" in child.cmdline()]
        assert [child.pid for child in shippers] == [int(pid)]  # one for both jobs, this process's child
    assert not psutil.pid_exists(int(pid))  # stopped and reaped with the executor: no shipper outlives it


def _live_shippers() -> list[psutil.Process]:
    """This process's children running the real trace shipper (a zombie awaiting its reaper is not live)."""
    live = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if child.status() != psutil.STATUS_ZOMBIE and local.TRACE_SHIPPER in child.cmdline():
                live.append(child)
    return live


async def test_a_trace_shipper_goes_once_its_spool_is_shipped_and_a_later_traced_task_starts_another(
        tmp_path: Path, settings_env: dict[str, str], platform_settings, until_job_event, job_event) -> None:
    """Every sandboxed run has a spool of its own (an automl trial's among them): its shipper, which runs
    as the job's user, must not outlive it. The real launcher, tracer and shipper, and the test broker."""
    await ensure_topics(platform_settings, [TRACES])
    program = JobProgram(commands={"worker": py("pass")}, trace=True)
    work = tmp_path / "work"
    async with LocalExecutor(work_dir=work, shutdown_grace_s=0.5, platform_env=settings_env,
                             trace_shipper_idle_exit_s=0.2, sandbox="required") as executor:
        for job in (spec("trial-0", worker=1), spec("trial-1", worker=1)):
            run_dir = work / job.job_id / "attempt-0"
            await executor.launch(job, program, placement(job), attempt=0)
            assert job_event(await until_job_event(executor, job.job_id)).outcome is JobOutcome.SUCCEEDED
            shipper_log = run_dir / "trace-shipper.log"
            await wait_until(lambda: not _live_shippers(), timeout_s=60,
                             what=lambda log=shipper_log: f"the trial's shipper to exit idle: {log.read_text()[-2000:]}")
            assert "shipper idle, exiting" in shipper_log.read_text()
            spool = run_dir / "sandbox" / "trace-spool"
            assert not list(spool.rglob("*.json"))  # it went once the trial's events were shipped
            uid = int((work / job.job_id / "sandbox-uid").read_text())
            assert {p.stat().st_uid for p in spool.rglob("*")} == {uid}  # the tracer's and the shipper's files


async def test_tasks_get_the_platform_env_under_their_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, until_job_event, job_event) -> None:
    monkeypatch.setenv("OPML_TOPIC_PREFIX", "inherited-")
    monkeypatch.setenv("OPML_REDIS_PREFIX", "inherited:")
    code = "import os; print(os.environ['OPML_TOPIC_PREFIX'], os.environ['OPML_REDIS_PREFIX'], os.environ['OPML_X'])"
    platform = {"OPML_TOPIC_PREFIX": "platform-", "OPML_REDIS_PREFIX": "platform:", "OPML_X": "platform"}
    async with LocalExecutor(work_dir=tmp_path, platform_env=platform) as ex:
        job = JobSpec(job_id="env", job_class=JobClass.BE, roles={"worker": RoleSpec(1, Resources(cpu_millis=100))})
        await ex.launch(job, JobProgram(commands={"worker": [sys.executable, "-c", code]}, env={"OPML_X": "job"}),
                        {"worker": ("n0",)}, attempt=0)
        assert job_event(await until_job_event(ex, "env")).outcome is JobOutcome.SUCCEEDED
        assert await ex.logs("env", "worker", 0) == "platform- platform: job\n"  # inherited < platform < the job's


async def test_a_local_executor_is_never_released(tmp_path: Path) -> None:
    """Its runs are this machine's processes: no other orchestrator can adopt them."""
    async with LocalExecutor(work_dir=tmp_path / "work", sandbox="off") as local:
        with pytest.raises(FailedPrecondition, match="cannot be adopted"):
            await local.release()
        assert local.running
