"""The broker stopped while services work (issue 12, item 8): they stay up and lose nothing acknowledged.

A private broker (tansu on its durable S3 engine, its own SeaweedFS) serves a bundle-store, an
inference-router and a job-orchestrator. While it is stopped: bundles are committed (every
CommitBundle answers; the events wait in the outbox, its gauge counts them), a job runs to the end
(its events wait in the orchestrator's outbox) and the router answers every inference request (the
prediction log is at most once by design: what it could not send is dropped and counted). The broker
is started again on the same port and nothing is restarted: every commit's event reaches the topic
exactly once, so does each of the job's, a prediction made after the outage is published, and every prediction is either
published or counted as dropped.
"""

from __future__ import annotations

import asyncio
import re
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
import yaml
from opml.bundles.v1 import events_pb2 as bundle_events
from opml.jobs.v1 import jobs_pb2

from opml_bundle_store_contract.client import BundleStoreClient
from opml_bundle_store_contract.topics import BUNDLES
from opml_common.bus import CloudEvent
from opml_devstack.devinfra import DevInfra
from opml_devstack.testing.bus import poll_until, read_records
from opml_devstack.testing.services import TOKENS
from opml_inference_router.testing import mlp_config, write_model_dir
from opml_inference_router_contract.client import DeploymentClient
from opml_job_orchestrator_contract.client import JobClient
from opml_job_orchestrator_contract.jobspec import load_spec
from opml_job_orchestrator_contract.topics import JOBS

pytestmark = pytest.mark.timeout(300)

ROUTER = "OPML_INFERENCE_ROUTER_"
FLEET = {"pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 2, "cost_per_hour": 0.4,
                         "execution_provider": "CPUExecutionProvider"}],
         "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}], "min_replicas": 1}


def _metric(env: dict[str, str], prefix: str, name: str) -> float:
    port = env[f"{prefix}METRICS_PORT"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(value) for value in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _infer(target: str, data: np.ndarray) -> str:
    with triton.InferenceServerClient(target) as kserve:
        tensor = triton.InferInput("features", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        result = kserve.infer("mlp", [tensor], headers={"authorization": f"Bearer {TOKENS['writer']}"},
                              client_timeout=10)
    return result.get_response().model_version


def test_a_broker_outage_loses_no_acknowledged_event_and_services_recover_by_themselves(
        start_service, platform_settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    infra = DevInfra(workdir=tmp_path / "infra", kafka_storage="s3")
    endpoints = infra.start()
    try:
        private = endpoints.env()
        for key, value in private.items():  # the test's own reads go to the private broker too
            monkeypatch.setenv(key, value)
        settings = type(platform_settings)()
        fleet = tmp_path / "fleet.yaml"
        fleet.write_text(yaml.safe_dump(FLEET))
        store_env = start_service.env("bundle-store", extra_env=private)
        store = start_service("bundle-store", env=store_env)
        router = start_service("inference-router", extra_env={
            **private, "OPML_INFERENCE_ROUTER_FLEET": str(fleet),
            "OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA": "1"})
        router_env = router.env
        jobs_env = start_service.env("job-orchestrator", extra_env=private)
        orchestrator = start_service("job-orchestrator", env=jobs_env)
        model_dir = write_model_dir(tmp_path / "mlp", mlp_config("mlp", pool_kinds=("cpu",), precisions=("fp32",)))
        with DeploymentClient(router.target, token=TOKENS["writer"]) as client:
            client.deploy(model_dir=str(model_dir))
        data = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
        with BundleStoreClient(store.target, token=TOKENS["writer"]) as client:
            client.create_context("plant")
            before = client.add("plant", "before", {"f": b"0"}, commit=True)  # announced while the broker is up
            topic = BUNDLES.full_name(settings.topic_prefix)
            assert len(asyncio.run(read_records(settings, topic, 1))) == 1

            infra.process("tansu").stop()  # the outage: until the work below is done (no clock involved)
            committed = [client.add("plant", f"during-{n}", {"f": str(n).encode()}, commit=True) for n in range(5)]
            assert all(bundle.committed for bundle in committed)  # every commit answered
            poll_until(lambda: _metric(store_env, "OPML_BUNDLE_STORE_", "opml_bundle_store_outbox_pending_events") == 5,
                       timeout_s=30, what="the five events waiting in the outbox")
            assert [_infer(router.target, data) for _ in range(50)] == ["1"] * 50  # serving goes on
            with JobClient(orchestrator.target, token=TOKENS["writer"]) as jobs:  # a job runs through it
                jobs.submit(load_spec({"name": "through-the-outage", "class": "BE",
                                       "command": [sys.executable, "-c", "print('ran')"],
                                       "roles": {"worker": {"resources": {"cpu": 1, "memory": "64Mi"}}}}))
                poll_until(lambda: jobs.get("through-the-outage").status.state == jobs_pb2.JOB_STATE_SUCCEEDED,
                           timeout_s=60, what="the job succeeding while the broker is down")
            job_events = _metric(jobs_env, "OPML_JOB_ORCHESTRATOR_", "opml_job_orchestrator_outbox_pending_events")
            assert job_events >= 3  # submitted, started, succeeded at least: all waiting in the outbox
            infra.process("tansu").start()  # back on the same port, its log on S3; nothing else restarted

        records = asyncio.run(read_records(settings, topic, 6, timeout_s=120))
        events = [CloudEvent.from_kafka(r.headers, r.value) for r in records]
        uuids = [e.parse(bundle_events.BundleCommitted).bundle.uuid for e in events]
        assert sorted(uuids) == sorted([before.uuid, *(b.uuid for b in committed)])  # each once
        poll_until(lambda: _metric(store_env, "OPML_BUNDLE_STORE_", "opml_bundle_store_outbox_pending_events") == 0,
                   timeout_s=30, what="the outbox drained")
        records = asyncio.run(read_records(settings, JOBS.full_name(settings.topic_prefix), int(job_events),
                                           timeout_s=120))
        job_records = [CloudEvent.from_kafka(r.headers, r.value) for r in records]
        assert len(job_records) == job_events == len({e.id for e in job_records})  # each event once
        assert [e.type for e in job_records].count("opml.jobs.v1.JobSucceeded") == 1

        # The router's prediction log recovers by itself: a request after the outage is published, and
        # every prediction is accounted for (published, or dropped and counted: at most once by design).
        with triton.InferenceServerClient(router.target) as kserve:
            tensor = triton.InferInput("features", list(data.shape), "FP32")
            tensor.set_data_from_numpy(data)
            kserve.infer("mlp", [tensor], headers={"authorization": f"Bearer {TOKENS['writer']}"})

        def accounted() -> tuple[float, float] | None:
            published = _metric(router_env, ROUTER, "opml_inference_router_predictions_published_total")
            dropped = _metric(router_env, ROUTER, "opml_inference_router_predictions_dropped_total")
            return (published, dropped) if published + dropped == 51 else None

        published, dropped = poll_until(accounted, timeout_s=120, what="all 51 predictions published or dropped")
        assert published >= 1  # at least the one made after the outage reached the broker
    finally:
        infra.stop()
