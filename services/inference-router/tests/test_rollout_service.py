"""A progressive rollout in the real router process: a version whose requests fail is rolled back by
itself, the evidence read back from opml.deployments.v1, and the rollout RPCs keep their roles."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
import yaml
from opml.inference.v1 import deployment_events_pb2 as events
from tritonclient.utils import InferenceServerException

from opml_common.bus import CloudEvent
from opml_common.config import PlatformSettings
from opml_common.errors import PermissionDenied
from opml_devstack.testing.bus import read_records
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_inference_router.testing import mlp_classifier, mlp_config, write_model_dir
from opml_inference_router.testing.models import POISON, poisoned_mlp
from opml_inference_router_contract.client import DeploymentClient
from opml_inference_router_contract.topics import DEPLOYMENTS

FLEET = {
    "pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 4, "cost_per_hour": 0.4,
                    "execution_provider": "CPUExecutionProvider"}],
    "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}],
}
SPEC = {"steps": [{"weight": 50}, {"analysis": {
    "interval_s": 0.3, "count": 3, "inconclusive_limit": 100,
    "checks": {"error_rate": {"max_increase": 0.05, "min_requests": 20}}}}]}


@contextlib.contextmanager
def poisoned_traffic(target: str) -> Iterator[dict[str, int]]:
    """Requests holding POISON, one after another from a thread, until the block ends."""
    counts = {"ok": 0, "failed": 0}
    stop = threading.Event()
    data = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    data[0, 0] = POISON

    def send() -> None:
        with triton.InferenceServerClient(target) as client:
            tensor = triton.InferInput("features", [1, 16], "FP32")
            tensor.set_data_from_numpy(data)
            while not stop.is_set():
                try:
                    client.infer("mlp", [tensor], headers={"authorization": f"Bearer {TOKENS['writer']}"})
                    counts["ok"] += 1
                except InferenceServerException:
                    counts["failed"] += 1

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        yield counts
    finally:
        stop.set()
        thread.join()


def first_event(settings: PlatformSettings, kind: type) -> tuple[CloudEvent, list[CloudEvent]]:
    """Reads opml.deployments.v1 from the start, one more record at a time, until a ``kind`` event."""
    topic, count = DEPLOYMENTS.full_name(settings.topic_prefix), 1
    while True:
        read = [CloudEvent.from_kafka(r.headers, r.value) for r in asyncio.run(read_records(settings, topic, count))]
        found = [e for e in read if e.type == kind.DESCRIPTOR.full_name]
        if found:
            return found[0], read
        count = len(read) + 1


def test_a_failing_version_is_rolled_back_with_its_evidence_on_the_bus(start_service: ServiceStarter,
                                                                        platform_settings: PlatformSettings,
                                                                        tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(FLEET))
    router = start_service("inference-router", env=start_service.env("inference-router", extra_env={
        "OPML_INFERENCE_ROUTER_FLEET": str(fleet), "OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA": "1"}))
    config = mlp_config("mlp", pool_kinds=("cpu",), precisions=("fp32",), max_queue_delay_us=None)
    stable = write_model_dir(tmp_path / "v1", config, mlp_classifier(seed=1))
    poisoned = write_model_dir(tmp_path / "v2", config, poisoned_mlp(seed=2))
    (poisoned / "rollout.yaml").write_text(yaml.safe_dump(SPEC))
    with DeploymentClient(router.target, token=TOKENS["writer"]) as writer:
        writer.deploy(model_dir=str(stable))
        with poisoned_traffic(router.target) as counts:
            deployed = writer.deploy(model_dir=str(poisoned))
            assert {v.version: v.traffic_percent for v in deployed.versions} == {1: 100, 2: 0}
            aborted, read = first_event(platform_settings, events.RolloutAborted)
        with pytest.raises(PermissionDenied):
            writer.abort_rollout("mlp")  # admin only
    with DeploymentClient(router.target, token=TOKENS["reader"]) as reader:
        shown, versions = reader.get_rollout("mlp"), list(reader.get("mlp").versions)
    assert counts["ok"] > 0 and counts["failed"] > 0
    assert aborted.subject == "mlp"
    message = aborted.parse(events.RolloutAborted)
    error_rate = message.checks[0]
    assert (message.version, message.stable_version, error_rate.check, error_rate.verdict) == (
        2, 1, "error_rate", "FAILED")
    assert error_rate.new_value == 1.0 and error_rate.stable_value == 0.0 and error_rate.bound == 0.05
    assert error_rate.new_requests >= 20 and error_rate.stable_requests >= 20
    rollout = [e.type.rsplit(".", 1)[1] for e in read if ".Rollout" in e.type]
    assert rollout[:2] == ["RolloutStepStarted", "RolloutStepStarted"] and rollout[-1] == "RolloutAborted"
    assert set(rollout[2:-1]) == {"RolloutAnalysisCompleted"}
    assert shown.phase == "ABORTED" and shown.checks[0].verdict == "FAILED"
    assert [(v.version, v.traffic_percent) for v in versions] == [(1, 100)]
