"""The injected tracer end to end: unmodified TensorFlow programs run under the launcher, against the
real broker, S3 and Redis of the ``infra`` fixture. Events are read back from the broker; a run is
complete when its TracerStopped arrived, its batches' sequences have no gap and their steps add up
to TracerStopped's count."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from aiokafka import AIOKafkaConsumer
from google.protobuf.message import Message
from opml.traces.v1 import events_pb2 as pb

from opml_common.bus import CloudEvent, ensure_topics
from opml_common.config import PlatformSettings
from opml_common.storage import s3_client
from opml_devstack.devinfra import free_port
from opml_devstack.testing.bus import poll_until
from opml_trace_collector.inject import spool
from opml_trace_collector.session import iter_session
from opml_trace_collector_contract.topics import TRACES

PROGRAMS = Path(__file__).parent / "programs"
pytestmark = pytest.mark.slow

Event = tuple[str, CloudEvent, Message]  # (Kafka key, the CloudEvent, its parsed data)


class Run:
    """One traced program and what it left on disk."""

    def __init__(self, process: subprocess.Popen, home: Path) -> None:
        self.process = process
        self.home = home

    def wait(self, timeout_s: float = 60) -> int:
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise

    @property
    def stderr(self) -> str:
        return (self.home / "stderr.txt").read_text()

    def spooled_ids(self, spool: Path | None = None) -> list[str]:
        ids = []
        for path in sorted((spool or self.home / "spool").rglob("*.json")):
            headers = dict(json.loads(path.read_text())["headers"])
            ids.append(headers["ce_id"])
        return ids


@pytest.fixture
def traced(settings_env: dict[str, str], platform_settings: PlatformSettings, tmp_path: Path):
    """Start a program under ``python -m opml_trace_collector.inject.run``; all are killed at the end."""
    asyncio.run(ensure_topics(platform_settings, [TRACES]))
    runs: list[Run] = []

    def start(args: list[str], *, job: str, worker: str | None = None, env: dict[str, str] | None = None,
              shipper: bool = True) -> Run:
        home = tmp_path / f"run{len(runs)}"
        home.mkdir()
        full_env = {**os.environ, **settings_env, "OPML_TRACE_SPOOL_DIR": str(home / "spool"),
                    "OPML_TRACE_SESSION_DIR": str(home / "sessions"), "OPML_TRACE_FLUSH_INTERVAL_S": "0.5",
                    "OPML_TRACE_POLL_S": "0.2", "OPML_TRACE_BUCKET": settings_env["OPML_TOPIC_PREFIX"] + "traces",
                    "TF_CPP_MIN_LOG_LEVEL": "2",
                    # these tests read every event back: give the last batch time (the bound has its own test)
                    "OPML_TRACE_EXIT_TIMEOUT_S": "5", "OPML_TRACE_SHIPPER_IDLE_EXIT_S": "20", **(env or {})}
        launcher = [sys.executable, "-m", "opml_trace_collector.inject.run", "--job", job]
        if not shipper:
            launcher.append("--no-shipper")
        if worker:
            launcher += ["--worker", worker]
        with open(home / "stderr.txt", "w") as err:
            process = subprocess.Popen([*launcher, "--", *args], env=full_env, cwd=home, stderr=err,
                                       stdout=subprocess.DEVNULL)
        run = Run(process, home)
        runs.append(run)
        return run

    yield start
    for run in runs:
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait()
    stop_shippers(tmp_path)


def stop_shippers(root: Path) -> None:
    """Stop the shippers the launchers started under ``root`` (each holds its outlet's lock, pid inside)."""
    for lock in root.rglob(spool.SHIPPER_LOCK):
        pid = spool.shipper_pid(lock.parent)
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            wait_for(lambda outlet=lock.parent: spool.shipper_pid(outlet) is None, "the shipper to stop", 20)


async def _consume(settings: PlatformSettings, done: Callable[[list[Event]], bool], timeout_s: float) -> list[Event]:
    consumer = AIOKafkaConsumer(TRACES.full_name(settings.topic_prefix), bootstrap_servers=settings.kafka_bootstrap,
                                group_id=None, auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    events: list[Event] = []
    try:
        deadline = time.monotonic() + timeout_s
        while not done(events):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s}s; events so far: {[e[1].type for e in events]}")
            for part in (await consumer.getmany(timeout_ms=300)).values():
                for record in part:
                    event = CloudEvent.from_kafka(record.headers, record.value)
                    events.append((record.key.decode(), event, event.parse(getattr(pb, event.type.rsplit(".", 1)[1]))))
    finally:
        await consumer.stop()
    return events


def events_until(settings: PlatformSettings, done: Callable[[list[Event]], bool], timeout_s: float = 180) -> list[Event]:
    """The traces topic's events from the start, read until ``done(events)`` (``timeout_s`` is a fail-safe:
    at load ~7 a traced Keras job took over 40 s from its TracerStarted to its first step)."""
    return asyncio.run(_consume(settings, done, timeout_s))


def of(events: list[Event], kind: type) -> list:
    return [message for _, _, message in events if isinstance(message, kind)]


def stopped(job: str, count: int = 1) -> Callable[[list[Event]], bool]:
    return lambda events: sum(1 for m in of(events, pb.TracerStopped) if m.job == job) >= count


def run_events(settings: PlatformSettings, job: str, runs: int = 1) -> list[Event]:
    """All events of ``job`` once its ``runs`` runs stopped, each once (delivery is at least once: a
    publish cancelled at exit after the broker took it is sent again, with the same id, and
    consumers deduplicate by id); asserts each run is complete."""
    unique: dict[str, Event] = {}
    for event in events_until(settings, stopped(job, runs)):
        if event[2].job == job:
            unique.setdefault(event[1].id, event)
    events = list(unique.values())
    for stop in of(events, pb.TracerStopped):
        batches = [b for b in of(events, pb.StepMetricsBatch) if b.session_id == stop.session_id]
        assert sorted(b.sequence for b in batches) == list(range(len(batches))), "no batch missing"
        assert sum(len(b.steps) for b in batches) == stop.steps
        assert len([s for s in of(events, pb.TracerStarted) if s.session_id == stop.session_id]) == 1
    return events


def steps_of(events: list[Event]) -> list[pb.StepRecord]:
    return [s for b in sorted(of(events, pb.StepMetricsBatch), key=lambda b: (b.session_id, b.sequence)) for s in b.steps]


def wait_for(predicate: Callable[[], object], what: str, timeout_s: float = 180) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def test_keras_cnn_is_traced_without_changes(traced, platform_settings: PlatformSettings) -> None:
    run = traced([sys.executable, str(PROGRAMS / "keras_cnn.py"), "--steps", "3", "--epochs", "2"], job="cnn")
    assert run.wait() == 0, run.stderr
    events = run_events(platform_settings, "cnn")
    assert {key for key, _, _ in events} == {"cnn/local"} and {e.subject for _, e, _ in events} == {"cnn/local"}
    [started] = of(events, pb.TracerStarted)
    assert started.worker == "local" and started.tf_version.startswith("2.") and started.pid > 0
    assert {"keras.Model.fit", "tf.function", "tf.compat.v1.Session.run",
            "keras.callbacks.CallbackList.on_epoch_end"} <= set(started.patched)
    steps = steps_of(events)
    assert Counter((pb.StepKind.Name(s.kind), s.signature) for s in steps) == {
        ("STEP_KIND_TRAIN", "keras.fit"): 6, ("STEP_KIND_EVALUATE", "keras.evaluate"): 2,
        ("STEP_KIND_PREDICT", "keras.predict"): 1}
    assert [s.step for s in steps if s.kind == pb.STEP_KIND_TRAIN] == list(range(6))
    epochs = [e for b in sorted(of(events, pb.StepMetricsBatch), key=lambda b: b.sequence) for e in b.epochs]
    assert [(e.epoch, e.fit) for e in epochs] == [(0, 0), (1, 0)]  # each epoch's Keras logs, once
    assert all(set(e.logs) == {"loss", "accuracy"} and e.logs["loss"] > 0 and e.time.seconds > 0 for e in epochs)
    assert all(s.examples == 16 and s.duration_s > 0 for s in steps)
    assert all(b.host and b.host[0].rss_bytes > 0 for b in of(events, pb.StepMetricsBatch))
    [stop] = of(events, pb.TracerStopped)
    assert (stop.steps, stop.exit_code) == (9, 0)
    wait_for(lambda: run.spooled_ids() == [], "the shipper to deliver everything: nothing left in the spool")
    assert "opml-trace: WARNING" not in run.stderr
    [session_file] = (run.home / "sessions" / "cnn").glob(f"local.{started.session_id}.jsonl")
    assert list(iter_session(session_file)) == steps, "the session file holds the same steps"


def test_custom_loop_counts_optimizer_steps_and_exit_code(traced, platform_settings: PlatformSettings) -> None:
    run = traced([sys.executable, str(PROGRAMS / "custom_loop.py"), "--steps", "8", "--exit-code", "3"],
                 job="loop", worker="w-7")
    assert run.wait() == 3, run.stderr
    events = run_events(platform_settings, "loop")
    assert {key for key, _, _ in events} == {"loop/w-7"}
    steps = steps_of(events)
    assert [(s.kind, s.signature, s.step) for s in steps] == [
        (pb.STEP_KIND_TRAIN, "tf.function:train_step", n) for n in range(8)]
    assert all(s.examples == 32 for s in steps)
    assert all(s.input_wait_s > 0 for s in steps), "time in the tf.data iterator's next() is measured"
    [stop] = of(events, pb.TracerStopped)
    assert (stop.steps, stop.exit_code) == (8, 3)


def test_eager_custom_loop_step_runs_from_tape_to_apply_gradients(traced, platform_settings: PlatformSettings) -> None:
    run = traced([sys.executable, str(PROGRAMS / "custom_loop.py"), "--steps", "5", "--eager"], job="eager")
    assert run.wait() == 0, run.stderr
    steps = steps_of(run_events(platform_settings, "eager"))
    assert [(s.kind, s.signature) for s in steps] == [(pb.STEP_KIND_TRAIN, "optimizer.apply_gradients")] * 5
    assert all(s.duration_s > 0 and s.input_wait_s > 0 for s in steps)


def test_session_run_signatures(traced, platform_settings: PlatformSettings) -> None:
    run = traced([sys.executable, str(PROGRAMS / "session_v1.py")], job="v1")
    assert run.wait() == 0, run.stderr
    steps = steps_of(run_events(platform_settings, "v1"))
    counts = Counter(s.signature for s in steps)
    assert counts["session.run:loss:0,train_op"] == 5 and counts["monitored_session.run:train_op"] == 3
    assert all(s.kind == pb.STEP_KIND_SESSION_RUN for s in steps)
    assert all(s.examples == 8 for s in steps if "train_op" in s.signature)


def test_capture_armed_from_outside_uploads_a_chrome_trace(traced, settings_env: dict[str, str],
                                                           platform_settings: PlatformSettings,
                                                           tmp_path: Path) -> None:
    go = tmp_path / "stop-now"
    run = traced([sys.executable, str(PROGRAMS / "keras_cnn.py"), "--steps", "4", "--wait-file", str(go)],
                 job="cap")
    events_until(platform_settings, lambda events: any(b.steps for b in of(events, pb.StepMetricsBatch)))
    client = redis.Redis.from_url(settings_env["OPML_REDIS_URL"])
    key = f"{settings_env['OPML_REDIS_PREFIX']}traces:capture:cap"
    client.set(key, json.dumps({"capture_id": "c1", "steps": 3, "workers": []}))
    try:
        events = events_until(platform_settings, lambda events: bool(
            of(events, pb.CaptureCompleted) or of(events, pb.CaptureFailed)))
    finally:
        go.touch()
        client.delete(key)
    assert run.wait() == 0, run.stderr
    assert of(events, pb.CaptureFailed) == []
    [completed] = of(events, pb.CaptureCompleted)
    bucket = settings_env["OPML_TOPIC_PREFIX"] + "traces"
    assert (completed.capture_id, completed.worker, completed.steps) == ("c1", "local", 3)
    assert completed.trace_url == f"s3://{bucket}/traces/cap/c1/local.trace.json.gz"
    data = s3_client(platform_settings).get_object(bucket, "traces/cap/c1/local.trace.json.gz").read()
    assert len(data) == completed.size_bytes
    trace = json.loads(gzip.decompress(data))
    assert trace["displayTimeUnit"] == "ms"
    assert {k: trace["metadata"][k] for k in ("job", "worker", "capture_id", "first_step", "steps")} == {
        "job": "cap", "worker": "local", "capture_id": "c1", "first_step": completed.first_step, "steps": 3}
    assert trace["metadata"]["tf_version"].startswith("2.")
    assert len(trace["traceEvents"]) == completed.event_count
    steps = [e for e in trace["traceEvents"] if e.get("cat") == "step"]
    ops = [e for e in trace["traceEvents"] if e.get("cat") == "op"]
    assert [e["name"] for e in steps] == [f"step {n}" for n in range(completed.first_step, completed.first_step + 3)]
    assert ops and all(e["ph"] == "X" and e["dur"] >= 0 and e["args"]["op_type"] and e["args"]["op_name"]
                       for e in ops)
    assert any("Conv2D" in e["args"]["op_type"] for e in ops), sorted({e["args"]["op_type"] for e in ops})
    first, last = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    assert any(first <= e["ts"] <= last for e in ops), "ops fall inside the traced steps"
    assert any(e["ph"] == "M" and e["name"] == "thread_name" for e in trace["traceEvents"])


def test_job_ending_mid_capture_announces_failure_not_a_trace(traced, settings_env: dict[str, str],
                                                             platform_settings: PlatformSettings,
                                                             tmp_path: Path) -> None:
    go, job_tmp = tmp_path / "stop-now", tmp_path / "job-tmp"
    job_tmp.mkdir()
    run = traced([sys.executable, str(PROGRAMS / "custom_loop.py"), "--wait-file", str(go)], job="cut",
                 env={"TMPDIR": str(job_tmp)})
    events_until(platform_settings, lambda events: any(b.steps for b in of(events, pb.StepMetricsBatch)))
    client = redis.Redis.from_url(settings_env["OPML_REDIS_URL"])
    client.set(f"{settings_env['OPML_REDIS_PREFIX']}traces:capture:cut",
               json.dumps({"capture_id": "big", "steps": 10**9, "workers": ["local"]}))
    # The capture made its profiler's folder (in the job's TMPDIR) at the first step after it was armed.
    poll_until(lambda: list(job_tmp.glob("opml-capture-*")), timeout_s=180, what="the capture to start profiling")
    go.touch()
    assert run.wait() == 0, run.stderr
    events = run_events(platform_settings, "cut")
    assert of(events, pb.CaptureCompleted) == []
    [failed] = of(events, pb.CaptureFailed)
    assert failed.capture_id == "big" and "ended" in failed.reason
    bucket = settings_env["OPML_TOPIC_PREFIX"] + "traces"
    s3 = s3_client(platform_settings)
    assert not s3.bucket_exists(bucket) or not list(s3.list_objects(bucket, prefix="traces/cut/", recursive=True))


def test_global_switch_off_records_no_steps(traced, settings_env: dict[str, str],
                                            platform_settings: PlatformSettings) -> None:
    client = redis.Redis.from_url(settings_env["OPML_REDIS_URL"])
    client.set(f"{settings_env['OPML_REDIS_PREFIX']}traces:enabled", "0")
    run = traced([sys.executable, str(PROGRAMS / "custom_loop.py"), "--steps", "5"], job="off")
    assert run.wait() == 0, run.stderr
    events = run_events(platform_settings, "off")
    assert of(events, pb.StepMetricsBatch) == [] and of(events, pb.TracerStopped)[0].steps == 0


def test_bus_down_job_unaffected_metrics_delivered_later(traced, broker_gate,
                                                        platform_settings: PlatformSettings) -> None:
    gate = broker_gate()  # the broker's address for the job and its shipper, answering nothing yet
    run = traced([sys.executable, str(PROGRAMS / "custom_loop.py"), "--steps", "6"], job="down",
                 env={"OPML_KAFKA_BOOTSTRAP": gate.address, "OPML_TRACE_EXIT_TIMEOUT_S": "0.1"})
    assert run.wait() == 0, run.stderr
    spooled = run.spooled_ids()
    assert len(spooled) >= 3, "TracerStarted, batches and TracerStopped wait in the spool"
    gate.open()  # the broker is back: the shipper the launcher started delivers them
    events = run_events(platform_settings, "down")
    assert sorted(e.id for _, e, _ in events) == sorted(spooled)
    assert len(steps_of(events)) == 6
    wait_for(lambda: run.spooled_ids() == [], "the shipper to delete what it delivered")


class BrokerGate:
    """A broker address that answers nothing (connections held open, never read) until ``open``,
    then passes each new connection through to the real broker: the broker down, then back."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._server = socket.create_server(("127.0.0.1", 0))
        self._held: list[socket.socket] = []
        self._open = threading.Event()
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:
                return
            if not self._open.is_set():
                self._held.append(connection)
                continue
            upstream = socket.create_connection(self._target)
            for a, b in ((connection, upstream), (upstream, connection)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for each in (source, sink):
            with contextlib.suppress(OSError):
                each.shutdown(socket.SHUT_RDWR)

    def open(self) -> None:
        self._open.set()
        for connection in self._held:  # the clients waiting on them reconnect, now through
            connection.close()

    def close(self) -> None:
        self._server.close()
        for connection in self._held:
            connection.close()


@pytest.fixture
def broker_gate(platform_settings: PlatformSettings):
    gates: list[BrokerGate] = []

    def make() -> BrokerGate:
        gates.append(BrokerGate(platform_settings.kafka_bootstrap.split(",")[0]))
        return gates[-1]

    yield make
    for gate in gates:
        gate.close()


def test_job_ending_with_an_undelivered_spool_waits_only_the_bound(traced, broker_gate,
                                                                  platform_settings: PlatformSettings) -> None:
    bound = 0.2
    gate = broker_gate()
    run = traced([sys.executable, str(PROGRAMS / "custom_loop.py"), "--steps", "7"], job="silent",
                 env={"OPML_KAFKA_BOOTSTRAP": gate.address, "OPML_TRACE_EXIT_TIMEOUT_S": str(bound)})
    assert run.wait() == 0, run.stderr
    found = re.search(r"the last events were not delivered within ([\d.]+) s \(the job waited ([\d.]+) s at "
                      r"exit, ([\d.]+) s of them for the shipper\)", run.stderr)
    assert found, run.stderr
    assert float(found[1]) == bound
    # the tracer's own timing: its wait is the bound; the whole exit, spool writes included, a multiple of it
    assert float(found[3]) <= bound * 1.5 and float(found[2]) <= bound * 5, run.stderr
    spooled = run.spooled_ids()
    assert len(spooled) >= 3, "TracerStarted, the last batch and TracerStopped wait in the spool"
    gate.open()
    events = run_events(platform_settings, "silent")  # complete: no batch missing, steps add up
    assert sorted(e.id for _, e, _ in events) == sorted(spooled)
    assert len(steps_of(events)) == 7 and of(events, pb.TracerStopped)[0].steps == 7
    wait_for(lambda: run.spooled_ids() == [], "the shipper to delete what it delivered")


def test_a_job_ends_without_a_shipper_and_its_events_arrive_once_one_starts(
        traced, settings_env: dict[str, str], platform_settings: PlatformSettings, tmp_path: Path) -> None:
    """Delivered as the job wrote them: the same ids, in the same order per run."""
    spool_dir = tmp_path / "shared-spool"
    first = traced([sys.executable, str(PROGRAMS / "custom_loop.py"), "--steps", "3"], job="later",
                   env={"OPML_TRACE_SPOOL_DIR": str(spool_dir), "OPML_TRACE_EXIT_TIMEOUT_S": "0"}, shipper=False)
    assert first.wait() == 0, first.stderr
    spooled = first.spooled_ids(spool_dir)
    assert len(spooled) >= 3 and "opml-trace: WARNING" not in first.stderr, "no bound to wait: no warning"
    second = traced([sys.executable, str(PROGRAMS / "custom_loop.py"), "--steps", "2"], job="later",
                    env={"OPML_TRACE_SPOOL_DIR": str(spool_dir)})  # its launcher starts the shipper
    assert second.wait() == 0, second.stderr
    events = run_events(platform_settings, "later", runs=2)
    first_session = {m.session_id for _, _, m in events if isinstance(m, pb.TracerStopped) and m.steps == 3}
    in_broker = [e.id for _, e, m in events if getattr(m, "session_id", None) in first_session]
    assert in_broker == spooled, "the first run's events, each once, in the order it wrote them"
    assert sorted(stop.steps for stop in of(events, pb.TracerStopped)) == [2, 3]
    wait_for(lambda: first.spooled_ids(spool_dir) == [], "the shipper to delete what it delivered")
    wait_for(lambda: spool.run_folders(next(spool_dir.iterdir())) == [], "the finished runs' folders to go")


def test_two_shippers_never_both_run(settings_env: dict[str, str], tmp_path: Path) -> None:
    env = {**os.environ, **settings_env, "OPML_TRACE_SPOOL_DIR": str(tmp_path / "spool")}
    command = [sys.executable, "-m", "opml_trace_collector.inject.ship", "--idle-exit-s", "0"]
    shippers = [subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        wait_for(lambda: sum(p.poll() is not None for p in shippers) == 2, "two of the three to give up", 60)
        [alive] = [p for p in shippers if p.poll() is None]
        [outlet] = (tmp_path / "spool").iterdir()
        assert spool.shipper_pid(outlet) == alive.pid
        for loser in (p for p in shippers if p is not alive):
            assert loser.returncode == 0 and "a shipper already delivers" in loser.stderr.read()
    finally:
        for process in shippers:
            if process.poll() is None:
                process.terminate()
                process.wait(20)


def test_program_without_tensorflow_runs_untraced_with_one_warning(traced) -> None:
    run = traced([sys.executable, "-c", "import json, sys; print(json.dumps(1)); sys.exit(7)"], job="plain")
    assert run.wait() == 7
    warnings = [line for line in run.stderr.splitlines() if line.startswith("opml-trace: WARNING")]
    assert warnings == ["opml-trace: WARNING: the program did not import TensorFlow; it ran untraced"]
    assert not (run.home / "sessions").exists() and run.spooled_ids() == []


def test_multi_worker_mirrored_strategy_workers_are_traced_separately(traced,
                                                                      platform_settings: PlatformSettings) -> None:
    cluster = {"worker": [f"localhost:{free_port()}", f"localhost:{free_port()}"]}
    runs = [traced([sys.executable, str(PROGRAMS / "mwms_worker.py"), "--steps", "4"], job="mwms",
                   env={"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})})
            for index in range(2)]
    assert [run.wait(90) for run in runs] == [0, 0], [run.stderr[-2000:] for run in runs]
    events = run_events(platform_settings, "mwms", runs=2)
    for worker in ("worker-0", "worker-1"):
        mine = [e for e in events if e[0] == f"mwms/{worker}"]
        assert [s.worker for s in of(mine, pb.TracerStarted)] == [worker]
        train = [s for s in steps_of(mine) if s.kind == pb.STEP_KIND_TRAIN]
        assert [(s.signature, s.step) for s in train] == [("tf.function:train_step", n) for n in range(4)]
        assert all(s.input_wait_s > 0 for s in train), "the distributed iterator's next() is timed"
        assert all(s.examples == 8 for s in train), "per-worker share of the global batch of 16"
