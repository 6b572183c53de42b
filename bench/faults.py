"""Faults, injected into real service processes on the real broker, S3 and Redis, and what they cost.

Produces the "faults" table of docs/benchmarks.md. Each scenario starts what it needs (one DevInfra
for the whole run: tansu on SeaweedFS, the machine's Redis; services as `make up` starts them, on free
ports with their own prefixes and homes), injects one fault, lets a client with a deadline work
through it, and counts:

- **sent**: requests (RPC calls) the clients sent, retries included;
- **failed**: requests that returned an error;
- **failed, time left**: failed requests whose deadline still had room for the recovery (the fault
  was over before that deadline): the platform failed them instead of waiting, and the client had to
  retry them itself (goal 0);
- **events acked / lost / applied twice**: changes the platform acknowledged (to the client or, for
  a consumer, what the broker acknowledged to the producer), those with no event (or no effect) after
  recovery (goal 0), and those whose event came under two ids or whose effect counted twice (goal 0);
- **recover s**: from the fault to the first request served again (or the consumer caught up).

Scenarios (``--only`` picks some):

- ``bundle-push``: bundle-store SIGKILLed during a push of a 120-file bundle, restarted at once (as
  the stack's supervisor does); a client adds, commits and pushes bundles in a loop, retrying
  UNAVAILABLE within a 30 s deadline per operation; events read back from the bundles topic.
- ``bundle-announce``: a process of bundle-store's core SIGKILLed exactly between a commit's manifest
  and its event (its emitter kills it); the service started over that home; the topic read back.
- ``router-deploy``: the inference-router SIGKILLed mid-deploy (its worker SIGSTOPped so the deploy
  waits after recording DEPLOYING), restarted; the client retries Deploy until its version serves.
- ``router-restart``: the router SIGKILLed while 4 closed-loop KServe callers (10 s deadlines) send
  requests; restarted over its Redis state; requests until the restored version answers again.
- ``trace-aggregate``: the trace-collector SIGKILLed right after applying half of a run's batches,
  the rest (and 10 re-sent batches) published while it is down, then restarted.
- ``redis-restart``: a private redis-server (append-only file) under a trace-collector stopped for
  ``--redis-outage-s`` (5) while batches arrive and a reader queries the run, then started again.
- ``broker-outage``: the broker stopped for ``--broker-outage-s`` (30) while 4 callers use the router
  and a client commits a bundle every 0.5 s; started again; nothing restarted.

    .venv/bin/python bench/faults.py [--only bundle-push router-restart ...] [--broker-outage-s 30]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis
import tritonclient.grpc as triton
import yaml
from aiokafka import AIOKafkaConsumer
from google.protobuf.timestamp_pb2 import Timestamp
from opml.inference.v1 import deployments_pb2
from opml.traces.v1 import events_pb2 as trace_events
from opml.traces.v1 import traces_pb2

from opml_bundle_store_contract.client import BundleStoreClient
from opml_bundle_store_contract.topics import BUNDLES
from opml_common.bus import CloudEvent, EventPublisher
from opml_common.config import PlatformSettings
from opml_common.errors import NotFound, OpmlError
from opml_common.retry import Backoff
from opml_devstack.devinfra import DevInfra, Endpoints
from opml_devstack.process import ServiceProcess
from opml_devstack.stack import StackConfig, delete_redis_keys, service_environment
from opml_devstack.testing.bus import fresh_metrics
from opml_devstack.testing.services import service_spec
from opml_inference_router.testing import mlp_config, worker_processes, write_model_dir
from opml_inference_router_contract.client import DeploymentClient
from opml_inference_router_contract.topics import DEPLOYMENTS
from opml_trace_collector_contract.client import TraceCollectorClient
from opml_trace_collector_contract.topics import TRACES, tracer_source

ROOT = Path(__file__).resolve().parents[1]
CORE_CHILD = ROOT / "services" / "bundle-store" / "tests" / "core_child.py"
RETRY = Backoff(base_s=0.1, max_s=1.0)
FLEET = {"pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 2, "cost_per_hour": 0.4,
                         "execution_provider": "CPUExecutionProvider"}],
         "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}], "min_replicas": 1}


@dataclass
class Row:
    fault: str
    sent: int
    failed: int
    failed_time_left: int
    acked: int
    lost: int
    twice: int
    recover_s: float
    note: str = ""

    def markdown(self) -> str:
        return (f"| {self.fault} | {self.sent} | {self.failed} | {self.failed_time_left} | {self.acked} | {self.lost} "
                f"| {self.twice} | {self.recover_s:.2f} | {self.note} |")


class Requests:
    """Counts requests and their failures; a failure counts as 'time left' when its deadline is after
    the recovery (set once the fault is over)."""

    def __init__(self) -> None:
        self.sent = self.failed = 0
        self.failed_deadlines: list[float] = []
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], object], *, deadline: float) -> object:
        with self._lock:
            self.sent += 1
        try:
            return fn()
        except Exception:
            with self._lock:
                self.failed += 1
                self.failed_deadlines.append(deadline)
            raise

    def retried(self, fn: Callable[[], object], *, timeout_s: float) -> object:
        """``fn`` retried on retriable errors (and broken streams) until ``timeout_s`` has passed."""
        deadline = time.monotonic() + timeout_s
        for attempt in range(10_000):
            try:
                return self.call(fn, deadline=deadline)
            except OpmlError as error:
                if not error.retriable or time.monotonic() + RETRY.delay(attempt) > deadline:
                    raise
            except triton.InferenceServerException:
                if time.monotonic() + RETRY.delay(attempt) > deadline:
                    raise
            time.sleep(RETRY.delay(attempt))
        raise AssertionError("unreachable")

    def time_left(self, recovered_at: float) -> int:
        return sum(1 for deadline in self.failed_deadlines if deadline > recovered_at)


class Platform:
    """One DevInfra for the run and services started on it with fresh prefixes and homes; at the end the
    run's Redis keys (all under one prefix) are deleted: the machine's Redis outlives the bench."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.infra = DevInfra(workdir=workdir / "infra", kafka_storage="s3")
        self.endpoints: Endpoints | None = None
        self.redis_prefix = f"opml-bench:faults-{uuid.uuid4().hex[:8]}:"

    def __enter__(self) -> Platform:
        self.endpoints = self.infra.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.endpoints is not None:
                delete_redis_keys(self.endpoints.redis_url, self.redis_prefix)
        finally:
            self.infra.stop()

    def environment(self, services: list[str], **extra: str) -> tuple[dict[str, str], str]:
        """The services' environment (ports fixed, so a restart listens where it did) and the prefix."""
        assert self.endpoints is not None
        prefix = f"f{uuid.uuid4().hex[:8]}-"
        config = StackConfig(state_dir=self.workdir, free_ports=True, topic_prefix=prefix,
                             redis_prefix=f"{self.redis_prefix}{prefix}", homes=self.workdir / prefix)
        env, _ = service_environment([service_spec(name) for name in services], self.endpoints, config)
        return {**env, "OPML_KAFKA_SESSION_TIMEOUT_MS": "2000", "OPML_KAFKA_HEARTBEAT_INTERVAL_MS": "500",
                **extra}, prefix

    def service(self, name: str, env: dict[str, str]) -> ServiceProcess:
        spec = service_spec(name)
        port = int(env[f"{spec.settings.model_config['env_prefix']}GRPC_PORT"])
        return ServiceProcess(spec.module, port, env, self.workdir / "logs" / f"{name}-{port}.log")


@contextmanager
def settings_of(env: dict[str, str]) -> Iterator[PlatformSettings]:
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield PlatformSettings()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def read_topic(env: dict[str, str], topic: str, *, until: Callable[[list[CloudEvent]], bool],
               timeout_s: float = 60.0) -> list[CloudEvent]:
    """Every event of ``topic`` from the beginning, read until ``until(events)`` (then 0.5 s more)."""
    async def read() -> list[CloudEvent]:
        consumer = AIOKafkaConsumer(topic, bootstrap_servers=env["OPML_KAFKA_BOOTSTRAP"], group_id=None,
                                    auto_offset_reset="earliest", enable_auto_commit=False)
        await consumer.start()
        events: list[CloudEvent] = []
        try:
            deadline = time.monotonic() + timeout_s
            settled = None
            while time.monotonic() < deadline and (settled is None or time.monotonic() < settled):
                for records in (await consumer.getmany(timeout_ms=200)).values():
                    events.extend(CloudEvent.from_kafka(r.headers, r.value) for r in records)
                if settled is None and until(events):
                    settled = time.monotonic() + 0.5
        finally:
            await consumer.stop()
        return events

    return asyncio.run(read())


def wait_for(check: Callable[[], object], what: str, timeout_s: float = 60.0, every_s: float = 0.02) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if result := check():
                return result
        except (OpmlError, OSError, redis.ConnectionError):
            pass
        time.sleep(every_s)
    raise TimeoutError(f"{what} did not happen within {timeout_s:g} s")


# -- scenarios -----------------------------------------------------------------------------------------


def bundle_push(platform: Platform) -> Row:
    env, prefix = platform.environment(["bundle-store"], OPML_BUNDLE_STORE_TRANSFER_WORKERS="1")
    service = platform.service("bundle-store", env).start()
    remote = f"s3://{prefix.rstrip('-')}/faults"
    requests, rng = Requests(), random.Random(1)
    killed_at = recovered_at = 0.0
    acked: list[tuple[str, str]] = []  # (event type, uuid) the client was told happened
    try:
        with BundleStoreClient(service.target) as client:
            requests.retried(lambda: client.create_context("plant", remote), timeout_s=30)
            for index in range(12):
                files = {f"f/{n:03d}.bin": rng.randbytes(64 * 1024) for n in range(120)}
                added = requests.retried(lambda name=f"b{index}", files=files: client.add(
                    "plant", name, files, commit=True), timeout_s=30)
                acked.append(("opml.bundles.v1.BundleCommitted", added.uuid))

                def push(kill: bool = index == 6, uuid_: str = added.uuid) -> object:
                    nonlocal killed_at
                    for message in client.push("plant", uuid_):
                        if kill and message.files_done and not message.done and not killed_at:
                            killed_at = time.monotonic()
                            service.kill()  # SIGKILL mid-push; restarted at once, as the supervisor does
                            threading.Thread(target=service.start, daemon=True).start()
                        if message.done:
                            return message
                    raise AssertionError("the push stream ended without done")

                requests.retried(push, timeout_s=30)
                if killed_at and not recovered_at:
                    recovered_at = time.monotonic()
                acked.append(("opml.bundles.v1.BundlePushed", added.uuid))
        events = read_topic(env, BUNDLES.full_name(prefix), until=lambda evs: len(evs) >= len(acked))
    finally:
        service.stop()
    return _event_row("bundle-store SIGKILLed mid-push of a 120-file bundle (restarted at once)", requests, acked, events,
                      killed_at, recovered_at, "the push in flight fails UNAVAILABLE; its retries while the service restarts fail too; the "
                      "retry after succeeds")


def _event_row(fault: str, requests: Requests, acked: list[tuple[str, str]], events: list[CloudEvent],
               killed_at: float, recovered_at: float, note: str) -> Row:
    ids: dict[tuple[str, str], set[str]] = {}
    for event in events:
        uuid_ = _bundle_uuid(event)
        ids.setdefault((event.type, uuid_), set()).add(event.id)
    lost = sum(1 for key in acked if key not in ids)
    twice = sum(1 for key in set(acked) if len(ids.get(key, ())) > 1)
    return Row(fault, requests.sent, requests.failed, requests.time_left(recovered_at), len(acked), lost, twice,
               recovered_at - killed_at, note)


def _bundle_uuid(event: CloudEvent) -> str:
    from opml.bundles.v1 import events_pb2

    kind = getattr(events_pb2, event.type.rsplit(".", 1)[1])
    message = event.parse(kind)
    return message.uuid if kind is events_pb2.BundleDeleted else message.bundle.uuid


def bundle_announce(platform: Platform) -> Row:
    from opml_bundle_store.core import BundleStore
    from opml_common.events import RecordingEmitter

    env, prefix = platform.environment(["bundle-store"])
    home = Path(env["OPML_BUNDLE_STORE_HOME"])
    with BundleStore(home, None, events=RecordingEmitter()) as store:  # the bundles the child works on
        store.create_context("ctx")
        for name, commit in (("draft", False), ("doomed", True)):
            with store.new_bundle("ctx", name) as writer:
                writer.add_file("f", [name.encode()])
                writer.finish(commit=commit)
    changed, recover_s, events = [], [], []
    for op in ("add", "commit", "delete"):  # one crash, then one start of the service over the home, each
        child = subprocess.run([sys.executable, str(CORE_CHILD), "announce", str(home), "ctx", f"{op}:after-change"],
                               check=False, capture_output=True, text=True, timeout=120)
        assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
        [intent] = [json.loads(path.read_text()) for path in (home / "announcing").glob("*.json")]
        kind = {"committed": "BundleCommitted", "deleted": "BundleDeleted"}[intent["kind"]]
        changed.append((f"opml.bundles.v1.{kind}", intent["uuid"], intent["id"]))
        started = time.monotonic()
        service = platform.service("bundle-store", env).start()
        try:
            events = read_topic(env, BUNDLES.full_name(prefix), until=lambda evs: len(evs) >= len(changed))
            recover_s.append(time.monotonic() - started)
        finally:
            service.stop()
    by_key = Counter((e.type, _bundle_uuid(e)) for e in events)
    lost = sum(1 for kind, uuid_, _ in changed if not by_key[kind, uuid_])
    twice = sum(1 for kind, uuid_, _ in changed if by_key[kind, uuid_] > 1)
    same_ids = {e.id for e in events} == {c[2] for c in changed}
    return Row("bundle-store core SIGKILLed between manifest and event (x3: add, commit, delete)", 3, 3, 0,
               len(changed), lost, twice, max(recover_s),
               f"the process died, so no client was answered; recovery = service start to the event on the topic "
               f"(worst of 3); the events carry the ids written ahead: {same_ids}")


def router_deploy(platform: Platform) -> Row:
    fleet = platform.workdir / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(FLEET))
    env, prefix = platform.environment(["inference-router"], OPML_INFERENCE_ROUTER_FLEET=str(fleet),
                                       OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA="1")
    model_dir = write_model_dir(platform.workdir / f"{prefix}mlp", mlp_config("mlp", pool_kinds=("cpu",),
                                                                             precisions=("fp32",)))
    store = redis.Redis.from_url(env["OPML_REDIS_URL"])
    key = f"{env['OPML_REDIS_PREFIX']}inference-router:deployments"
    router = platform.service("inference-router", env).start()
    requests = Requests()
    [worker] = worker_processes(router.process.pid)
    os.kill(worker.pid, signal.SIGSTOP)
    killed_at = 0.0

    def first_deploy() -> None:
        with DeploymentClient(router.target) as client, contextlib.suppress(OpmlError):
            requests.call(lambda: client.deploy(model_dir=str(model_dir)), deadline=time.monotonic() + 60)

    caller = threading.Thread(target=first_deploy)
    caller.start()
    wait_for(lambda: (raw := store.hget(key, "mlp")) and b"DEPLOYING" in raw, "the version DEPLOYING")
    killed_at = time.monotonic()
    router.kill()
    os.kill(worker.pid, signal.SIGCONT)
    caller.join()
    try:
        router.start()
        with DeploymentClient(router.target) as client:
            deployed = requests.retried(lambda: client.deploy(model_dir=str(model_dir)), timeout_s=60)
        recovered_at = time.monotonic()
        [version] = [v for v in deployed.versions if v.state == deployments_pb2.SERVING]
        events = read_topic(env, DEPLOYMENTS.full_name(prefix),
                            until=lambda evs: any(e.type.endswith("ModelDeployed") for e in evs))
    finally:
        router.stop()
        store.close()
    deployed_events = [e for e in events if e.type.endswith("ModelDeployed")]
    return Row("inference-router SIGKILLed mid-deploy (restarted at once)", requests.sent, requests.failed,
               requests.time_left(recovered_at), 1, 0 if deployed_events else 1, max(0, len(deployed_events) - 1),
               recovered_at - killed_at,
               f"the interrupted v1 comes back FAILED ('interrupted by a restart'), retired when v{version.version} "
               f"serves")


def router_restart(platform: Platform) -> Row:
    fleet = platform.workdir / "fleet-restart.yaml"
    fleet.write_text(yaml.safe_dump(FLEET))
    env, prefix = platform.environment(["inference-router"], OPML_INFERENCE_ROUTER_FLEET=str(fleet),
                                       OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA="1")
    model_dir = write_model_dir(platform.workdir / f"{prefix}mlp", mlp_config("mlp", pool_kinds=("cpu",),
                                                                             precisions=("fp32",)))
    router = platform.service("inference-router", env).start()
    with DeploymentClient(router.target) as client:
        client.deploy(model_dir=str(model_dir))
    requests, stop = Requests(), threading.Event()
    data = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    served_after: list[float] = []
    killed = threading.Event()

    def caller() -> None:
        while not stop.is_set():
            deadline = time.monotonic() + 10
            try:
                with triton.InferenceServerClient(router.target) as kserve:
                    tensor = triton.InferInput("features", [1, 16], "FP32")
                    tensor.set_data_from_numpy(data)
                    requests.call(lambda tensor=tensor: kserve.infer("mlp", [tensor], client_timeout=10),
                                  deadline=deadline)
                if killed.is_set():
                    served_after.append(time.monotonic())
            except Exception:  # noqa: BLE001 - counted by Requests; the caller goes on, as a client retrying
                time.sleep(0.05)

    callers = [threading.Thread(target=caller) for _ in range(4)]
    for thread in callers:
        thread.start()
    try:
        wait_for(lambda: requests.sent > 200, "load before the kill")
        killed_at = time.monotonic()
        router.kill()
        killed.set()
        router.start()
        wait_for(lambda: served_after, "a request served after the restart", timeout_s=120)
        recovered_at = served_after[0]
        time.sleep(0.5)
    finally:
        stop.set()
        for thread in callers:
            thread.join()
        router.stop()
    return Row("inference-router SIGKILLed under load, restarted over its Redis state", requests.sent,
               requests.failed, requests.time_left(recovered_at), 0, 0, 0, recovered_at - killed_at,
               "4 closed-loop callers, 10 s deadlines; the router is the front: nothing holds a request while it "
               "restarts")


def trace_aggregate(platform: Platform) -> Row:
    env, _ = platform.environment(["trace-collector"], OPML_TRACE_COLLECTOR_BUCKET=f"faults-{uuid.uuid4().hex[:8]}")
    job, worker, session, batches, per = "faults", "worker-0", "s-faults", 60, 20

    def batch(sequence: int) -> trace_events.StepMetricsBatch:
        steps = []
        for step in range(sequence * per, (sequence + 1) * per):
            start = Timestamp()
            start.FromMicroseconds(1_700_000_000_000_000 + step * 10_000)
            steps.append(trace_events.StepRecord(step=step, kind=trace_events.STEP_KIND_TRAIN, signature="keras.fit",
                                                 start_time=start, duration_s=0.01, examples=32))
        return trace_events.StepMetricsBatch(job=job, worker=worker, session_id=session, sequence=sequence,
                                             steps=steps)

    def publish(messages: list) -> int:
        async def send() -> None:
            with settings_of(env) as settings:
                async with EventPublisher(settings, source="opml/bench",
                                          metrics=fresh_metrics("faults")[0]) as publisher:
                    for message in messages:
                        await publisher.publish(TRACES, CloudEvent.from_proto(
                            message, subject=f"{job}/{worker}", source=tracer_source(job, worker)))

        asyncio.run(send())
        return len(messages)

    def run() -> traces_pb2.Run | None:
        with TraceCollectorClient(collector.target) as client:
            try:
                runs = client.list_runs(job)
            except NotFound:
                return None
        return runs[0] if runs else None

    collector = platform.service("trace-collector", env).start()
    try:
        acked = publish([trace_events.TracerStarted(job=job, worker=worker, session_id=session),
                         *[batch(s) for s in range(batches // 2)]])
        wait_for(lambda: (r := run()) and r.steps == batches // 2 * per, "the first half applied")
        killed_at = time.monotonic()
        collector.kill()
        acked += publish([*[batch(s) for s in range(batches // 2, batches)],
                          *[batch(s) for s in range(batches // 2 - 10, batches // 2)],
                          trace_events.TracerStopped(job=job, worker=worker, session_id=session)])
        collector.start()
        final = wait_for(lambda: (r := run()) and r.state == traces_pb2.RUN_STATE_STOPPED and r, "the run's end",
                         timeout_s=120)
        recovered_at = time.monotonic()
    finally:
        collector.stop()
    expected = batches * per
    return Row("trace-collector SIGKILLed while aggregating (10 batches re-sent)", 0, 0, 0, acked,
               max(0, expected - final.steps), max(0, final.steps - expected), recovered_at - killed_at,
               f"steps counted {final.steps} of {expected}; recovery includes the restart and the catch-up")


def _metric(env: dict[str, str], service: str, name: str) -> float:
    import re
    import urllib.request

    port = env[f"{service_spec(service).settings.model_config['env_prefix']}METRICS_PORT"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


class Callers:
    """``count`` closed-loop KServe callers of ``model`` on ``target`` (10 s deadlines) until stopped."""

    def __init__(self, target: str, model: str, requests: Requests, count: int = 4) -> None:
        self.target, self.model, self.requests = target, model, requests
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(count)]
        self.served: list[float] = []
        for thread in self.threads:
            thread.start()

    def _loop(self) -> None:
        data = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
        with triton.InferenceServerClient(self.target) as kserve:
            while not self.stop.is_set():
                tensor = triton.InferInput("features", [1, 16], "FP32")
                tensor.set_data_from_numpy(data)
                try:
                    self.requests.call(lambda tensor=tensor: kserve.infer(self.model, [tensor], client_timeout=10),
                                       deadline=time.monotonic() + 10)
                    self.served.append(time.monotonic())
                except Exception:  # noqa: BLE001 - counted by Requests
                    time.sleep(0.05)

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()


def broker_outage(platform: Platform, outage_s: float) -> Row:
    fleet = platform.workdir / "fleet-broker.yaml"
    fleet.write_text(yaml.safe_dump(FLEET))
    env, prefix = platform.environment(["bundle-store", "inference-router"], OPML_INFERENCE_ROUTER_FLEET=str(fleet),
                                       OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA="1")
    store = platform.service("bundle-store", env).start()
    router = platform.service("inference-router", env).start()
    model_dir = write_model_dir(platform.workdir / f"{prefix}mlp", mlp_config("mlp", pool_kinds=("cpu",),
                                                                             precisions=("fp32",)))
    requests, committed = Requests(), []
    try:
        with DeploymentClient(router.target) as client:
            client.deploy(model_dir=str(model_dir))
        callers = Callers(router.target, "mlp", requests)
        with BundleStoreClient(store.target) as client:
            client.create_context("plant")
            broker = platform.infra.process("tansu")
            down_at = time.monotonic()
            broker.stop()
            while time.monotonic() - down_at < outage_s:  # commits go on through the outage, one every 0.5 s
                n = len(committed)
                bundle = requests.call(lambda n=n: client.add("plant", f"b{n}", {"f": str(n).encode()}, commit=True),
                                       deadline=time.monotonic() + 10)
                committed.append(("opml.bundles.v1.BundleCommitted", bundle.uuid))
                time.sleep(0.5)
            pending = _metric(env, "bundle-store", "opml_bundle_store_outbox_pending_events")
            broker.start()
            up_at = time.monotonic()
        wait_for(lambda: _metric(env, "bundle-store", "opml_bundle_store_outbox_pending_events") == 0,
                 "the outbox drained", timeout_s=120)
        recovered_at = time.monotonic()
        callers.close()
        events = read_topic(env, BUNDLES.full_name(prefix), until=lambda evs: len(evs) >= len(committed))
        served = requests.sent - requests.failed - len(committed)  # inference requests answered

        def predictions() -> tuple[float, float]:
            return (_metric(env, "inference-router", "opml_inference_router_predictions_published_total"),
                    _metric(env, "inference-router", "opml_inference_router_predictions_dropped_total"))

        with contextlib.suppress(TimeoutError):  # every served request's prediction published or counted dropped
            wait_for(lambda: sum(predictions()) >= served, "predictions accounted for", timeout_s=60, every_s=0.5)
        published, dropped = predictions()
    finally:
        router.stop()
        store.stop()
    row = _event_row(f"broker stopped {outage_s:g} s while the router serves and bundles are committed", requests,
                     committed, events, up_at, recovered_at,
                     f"{pending:.0f} events waited in the outbox; of {served} predictions (at most once by design) "
                     f"{published:.0f} published, {dropped:.0f} dropped and counted, "
                     f"{served - published - dropped:.0f} neither within 60 s; sent counts inferences and commits")
    return row


def redis_restart(platform: Platform, outage_s: float) -> Row:
    redis_dir = platform.workdir / "redis"
    redis_dir.mkdir(exist_ok=True)
    port = _free_port()
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(redis_dir), "--appendonly",
            "yes", "--appendfsync", "always", "--save", ""]
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"redis://127.0.0.1:{port}/0"
    wait_for(lambda: redis.Redis.from_url(url).ping(), "redis-server answering")
    env, _ = platform.environment(["trace-collector"], OPML_REDIS_URL=url,
                                  OPML_TRACE_COLLECTOR_BUCKET=f"faults-{uuid.uuid4().hex[:8]}")
    job, worker, session, per, batches = "faults-redis", "worker-0", "s-redis", 10, 0
    collector = platform.service("trace-collector", env).start()
    requests, stop = Requests(), threading.Event()
    served: list[float] = []

    def reader() -> None:  # a dashboard's queries of the run, 10 s deadlines
        with TraceCollectorClient(collector.target) as client:
            while not stop.is_set():
                with contextlib.suppress(OpmlError):
                    requests.call(lambda: client.list_runs(job), deadline=time.monotonic() + 10)
                    served.append(time.monotonic())
                time.sleep(0.05)

    try:
        sent = _publish_traces(env, job, worker, session, [trace_events.TracerStarted(
            job=job, worker=worker, session_id=session)], [])
        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        batches = 20
        sent += _publish_traces(env, job, worker, session, [], range(0, 10), per=per)
        down_at = time.monotonic()
        server.terminate()
        server.wait()
        sent += _publish_traces(env, job, worker, session, [], range(10, 20), per=per)  # wait in the broker
        time.sleep(max(0.0, outage_s - (time.monotonic() - down_at)))
        server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_for(lambda: redis.Redis.from_url(url).ping(), "redis-server answering again")
        up_at = time.monotonic()
        sent += _publish_traces(env, job, worker, session, [trace_events.TracerStopped(
            job=job, worker=worker, session_id=session)], [])

        def ended() -> traces_pb2.Run | None:
            with TraceCollectorClient(collector.target) as client:
                runs = client.list_runs(job)
            return runs[0] if runs and runs[0].state == traces_pb2.RUN_STATE_STOPPED else None

        final = wait_for(ended, "the run's end applied", timeout_s=120)
        recovered_at = min(t for t in served if t > up_at) if any(t > up_at for t in served) else time.monotonic()
        stop.set()
        thread.join()
    finally:
        stop.set()
        collector.stop()
        server.terminate()
        server.wait()
    expected = batches * per
    return Row(f"Redis (private, AOF) restarted after {outage_s:g} s under a trace-collector", requests.sent,
               requests.failed, requests.time_left(recovered_at), sent, max(0, expected - final.steps),
               max(0, final.steps - expected), recovered_at - up_at,
               f"queries while Redis is down fail UNAVAILABLE; steps counted {final.steps} of {expected}")


def _free_port() -> int:
    from opml_devstack.devinfra import free_port

    return free_port()


def _publish_traces(env: dict[str, str], job: str, worker: str, session: str, messages: list, sequences,
                    *, per: int = 10) -> int:
    batches = []
    for sequence in sequences:
        steps = []
        for step in range(sequence * per, (sequence + 1) * per):
            start = Timestamp()
            start.FromMicroseconds(1_700_000_000_000_000 + step * 10_000)
            steps.append(trace_events.StepRecord(step=step, kind=trace_events.STEP_KIND_TRAIN, signature="keras.fit",
                                                 start_time=start, duration_s=0.01, examples=32))
        batches.append(trace_events.StepMetricsBatch(job=job, worker=worker, session_id=session, sequence=sequence,
                                                     steps=steps))

    async def send() -> None:
        with settings_of(env) as settings:
            async with EventPublisher(settings, source="opml/bench", metrics=fresh_metrics("faults")[0]) as publisher:
                for message in [*batches, *messages]:
                    await publisher.publish(TRACES, CloudEvent.from_proto(
                        message, subject=f"{job}/{worker}", source=tracer_source(job, worker)))

    asyncio.run(send())
    return len(batches) + len(messages)


SCENARIOS = {"bundle-push": bundle_push, "bundle-announce": bundle_announce, "router-deploy": router_deploy,
             "router-restart": router_restart, "trace-aggregate": trace_aggregate, "redis-restart": redis_restart,
             "broker-outage": broker_outage}  # the broker last: the others share it


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--broker-outage-s", type=float, default=30.0)
    parser.add_argument("--redis-outage-s", type=float, default=5.0)
    args = parser.parse_args()
    outages = {"broker-outage": args.broker_outage_s, "redis-restart": args.redis_outage_s}
    rows = []
    with tempfile.TemporaryDirectory(prefix="opml-faults-") as tmp, Platform(Path(tmp)) as platform:
        for name in args.only:
            print(f"-- {name}", file=sys.stderr, flush=True)
            scenario = SCENARIOS[name]
            rows.append(scenario(platform, outages[name]) if name in outages else scenario(platform))
            print(rows[-1].markdown(), file=sys.stderr, flush=True)
    print("| fault | sent | failed | failed, time left | events acked | lost | applied twice | recover s | note |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        print(row.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
