"""Redis restarted while services run (issue 12, item 8): they stay up and go on by themselves.

A private redis-server (append-only file on, so a restart keeps what was acknowledged) serves a
trace-collector, an inference-router and a job-orchestrator running a job that ends while Redis is
down (its end is recorded once Redis is back). Redis is stopped and started again on the same port while
both run; nothing else is restarted. A query that needs Redis meanwhile fails UNAVAILABLE (retriable,
never INTERNAL); Redis stays down until the collector's consumer has retried past its attempts. The
collector applies a tracer's batches from before, during
(they wait in the broker) and after the restart, each exactly once (its Lua-applied aggregates and
the dedup keys survive); the router keeps serving the model it had, and a deploy after the restart
is stored (a router restarted after it brings both models back).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import redis
import tritonclient.grpc as triton
import yaml
from google.protobuf.timestamp_pb2 import Timestamp
from opml.jobs.v1 import jobs_pb2
from opml.traces.v1 import events_pb2
from opml.traces.v1 import traces_pb2 as pb

from opml_common.bus import CloudEvent, EventPublisher
from opml_common.errors import NotFound, Unavailable
from opml_devstack.devinfra import free_port
from opml_devstack.testing.bus import fresh_metrics, poll_until
from opml_devstack.testing.services import TOKENS
from opml_inference_router.testing import mlp_classifier, mlp_config, write_model_dir
from opml_inference_router_contract.client import DeploymentClient
from opml_job_orchestrator_contract.client import JobClient
from opml_job_orchestrator_contract.jobspec import load_spec
from opml_trace_collector_contract.client import TraceCollectorClient
from opml_trace_collector_contract.topics import TRACES, tracer_source

pytestmark = pytest.mark.timeout(300)

JOB, WORKER, SESSION, PER = "redis-restart", "worker-0", "s-redis", 10
FLEET = {"pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 2, "cost_per_hour": 0.4,
                         "execution_provider": "CPUExecutionProvider"}],
         "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}], "min_replicas": 1}


class PrivateRedis:
    """redis-server on a free port, its append-only file in ``directory`` (kept across a restart)."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.port = directory, free_port()
        self.process: subprocess.Popen | None = None
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        poll_until(lambda: self._answers(), timeout_s=30, what="redis-server answering")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)

    def _answers(self) -> bool:
        try:
            with redis.Redis.from_url(self.url) as client:
                return bool(client.ping())
        except redis.ConnectionError:
            return False


def _batch(sequence: int) -> events_pb2.StepMetricsBatch:
    steps = []
    for step in range(sequence * PER, (sequence + 1) * PER):
        start = Timestamp()
        start.FromMicroseconds(1_700_000_000_000_000 + step * 10_000)
        steps.append(events_pb2.StepRecord(step=step, kind=events_pb2.STEP_KIND_TRAIN, signature="keras.fit",
                                           start_time=start, duration_s=0.01, examples=32))
    return events_pb2.StepMetricsBatch(job=JOB, worker=WORKER, session_id=SESSION, sequence=sequence, steps=steps)


def _publish(settings, messages: list) -> None:
    async def send() -> None:
        async with EventPublisher(settings, source="opml/tracer-test", metrics=fresh_metrics("tracer-test")[0]) as pub:
            for message in messages:
                await pub.publish(TRACES, CloudEvent.from_proto(message, subject=f"{JOB}/{WORKER}",
                                                                source=tracer_source(JOB, WORKER)))

    asyncio.run(send())


def _steps(target: str) -> int:
    with TraceCollectorClient(target, token=TOKENS["reader"]) as client:
        try:
            runs = client.list_runs(JOB)
        except NotFound:
            return -1
    return runs[0].steps if runs else -1


def _handled(env: dict[str, str], outcome: str) -> float:
    """The collector's consumer's events_handled_total of that outcome, summed over topics and types."""
    port = env["OPML_TRACE_COLLECTOR_METRICS_PORT"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    pattern = rf'^opml_trace_collector_events_handled_total{{[^}}]*outcome="{outcome}"[^}}]*}} (\S+)$'
    return sum(float(value) for value in re.findall(pattern, text, re.M))


def _serves(target: str, name: str) -> bool:
    data = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    with triton.InferenceServerClient(target) as kserve:
        tensor = triton.InferInput("features", [1, 16], "FP32")
        tensor.set_data_from_numpy(data)
        return kserve.infer(name, [tensor], headers={"authorization": f"Bearer {TOKENS['writer']}"},
                            client_timeout=10).as_numpy("scores").shape == (1, 4)


def test_redis_restarted_under_running_services(start_service, platform_settings, unique_prefix: str,
                                                tmp_path: Path, job_dir: Path) -> None:
    private = PrivateRedis(tmp_path / "redis")
    private.start()
    try:
        fleet = tmp_path / "fleet.yaml"
        fleet.write_text(yaml.safe_dump(FLEET))
        on_private = {"OPML_REDIS_URL": private.url}
        collector_env = start_service.env("trace-collector", extra_env={
            **on_private, "OPML_TRACE_COLLECTOR_BUCKET": unique_prefix.rstrip("-")})
        collector = start_service("trace-collector", env=collector_env)
        router_env = start_service.env("inference-router", extra_env={
            **on_private, "OPML_INFERENCE_ROUTER_FLEET": str(fleet),
            "OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA": "1"})
        router = start_service("inference-router", env=router_env)
        orchestrator = start_service("job-orchestrator", extra_env=on_private)
        release = job_dir / "release"  # where the job's own user reads and writes
        ended = job_dir / "ended"
        waiter = ("import pathlib, time\n"
                  f"while not pathlib.Path({str(release)!r}).exists():\n    time.sleep(0.05)\n"
                  f"pathlib.Path({str(ended)!r}).touch()\n")
        with JobClient(orchestrator.target, token=TOKENS["writer"]) as jobs:  # runs across the restart
            jobs.submit(load_spec({"name": "across-redis", "class": "BE", "command": [sys.executable, "-c", waiter],
                                   "roles": {"worker": {"resources": {"cpu": 1, "memory": "64Mi"}}}}))
            poll_until(lambda: jobs.get("across-redis").status.state == jobs_pb2.JOB_STATE_RUNNING, timeout_s=60,
                       what="the job running")
        with DeploymentClient(router.target, token=TOKENS["writer"]) as client:
            client.deploy(model_dir=str(write_model_dir(tmp_path / "a", mlp_config("a", pool_kinds=("cpu",),
                                                                                   precisions=("fp32",)))))
        _publish(platform_settings, [events_pb2.TracerStarted(job=JOB, worker=WORKER, session_id=SESSION),
                                     *[_batch(s) for s in range(10)]])
        poll_until(lambda: _steps(collector.target) == 10 * PER, timeout_s=60, what="the first batches applied")

        private.stop()  # Redis goes away under both services
        _publish(platform_settings, [_batch(s) for s in range(10, 20)])  # wait in the broker meanwhile
        assert _serves(router.target, "a")  # the routing table is the router's own: serving goes on
        with TraceCollectorClient(collector.target, token=TOKENS["reader"]) as client, \
                pytest.raises(Unavailable, match="Redis is unreachable") as caught:
            client.list_runs(JOB)  # a query that needs Redis: retriable, not INTERNAL
        assert caught.value.retriable
        # Held down past the consumer's retry budget (5 attempts): a batch must wait, not be dead-lettered.
        poll_until(lambda: _handled(collector_env, "retried") >= 5, timeout_s=60,
                   what="the collector's consumer retrying past its attempts")
        release.touch()  # the job ends while Redis is down: its end is recorded when Redis is back
        poll_until(ended.exists, timeout_s=30, what="the job's last line run")
        private.start()  # back on its port with its data; no service restarted

        _publish(platform_settings, [*[_batch(s) for s in range(20, 30)], *[_batch(s) for s in range(5, 15)],
                                     events_pb2.TracerStopped(job=JOB, worker=WORKER, session_id=SESSION)])

        def stopped() -> pb.Run | None:
            with TraceCollectorClient(collector.target, token=TOKENS["reader"]) as client:
                runs = client.list_runs(JOB)
            return runs[0] if runs and runs[0].state == pb.RUN_STATE_STOPPED else None

        run = poll_until(stopped, timeout_s=120, what="the run's end applied after the restart", every_s=0.2)
        assert (run.steps, run.missing_batches) == (30 * PER, 0)  # each batch once, re-sent ones included
        assert _handled(collector_env, "dead_lettered") == 0
        with JobClient(orchestrator.target, token=TOKENS["reader"]) as jobs:
            poll_until(lambda: jobs.get("across-redis").status.state == jobs_pb2.JOB_STATE_SUCCEEDED, timeout_s=60,
                       what="the job's end recorded after the restart")

        b_dir = write_model_dir(tmp_path / "b", mlp_config("b", pool_kinds=("cpu",), precisions=("fp32",)),
                                mlp_classifier(seed=2))
        with DeploymentClient(router.target, token=TOKENS["writer"]) as client:
            client.deploy(model_dir=str(b_dir))  # stored in the restarted Redis
        assert _serves(router.target, "a") and _serves(router.target, "b")
        router.stop()
        router = start_service("inference-router", env=router_env)  # restored from that Redis
        assert _serves(router.target, "a") and _serves(router.target, "b")
    finally:
        private.stop()
