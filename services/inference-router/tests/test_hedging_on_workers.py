"""Backup requests on real worker processes, over both transports (issue 12, item 5).

Worker A holds its model's requests for a minute before it forms a batch; worker B answers at once.
A request whose primary is A gets a backup on B after the hedge delay; B wins, and the router
cancels the loser: A's worker drops the call from its batch queue at once (its queue is empty long
before the minute is up) and never runs it. The unit tests show the same on fakes
(test_routing_router.py) and on the batcher alone (test_runtime_batcher.py).
"""

from __future__ import annotations

import random
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from opml_devstack.testing.bus import fresh_metrics, sample, wait_until
from opml_inference_router.kserve import encode_request
from opml_inference_router.routing import ModelPolicy, Router
from opml_inference_router.routing.uds_replica import connect
from opml_inference_router.testing import mlp_classifier, mlp_config, write_model_dir
from opml_inference_router.worker import WorkerProcess

FLEET = {"pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 4096, "slots": 4,
                         "cost_per_hour": 1.0, "execution_provider": "CPUExecutionProvider"}],
         "pools": [{"name": "cpu-a", "kind": "cpu", "workers": 2}]}
HOLD_US = 60_000_000  # A's batch waits this long to fill: a dropped call shows long before


def _start(root: Path, name: str, delay_us: int, *, wait_when_idle: bool = False) -> WorkerProcess:
    models = root / name / "models"
    config = mlp_config("m", max_queue_delay_us=delay_us)
    config["dynamic_batching"]["wait_when_idle"] = wait_when_idle
    write_model_dir(models / "m", config, mlp_classifier(width=32, seed=3))
    worker = WorkerProcess("cpu", root / "fleet.yaml", root / f"{name}.log", models_dir=models,
                           env={"OPML_LOG_FORMAT": "text"}, uds=root / f"{name}.sock").start()
    with grpc.insecure_channel(worker.target) as channel:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).RepositoryModelLoad(
            pb.RepositoryModelLoadRequest(model_name="m"), timeout=60)
    return worker


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    root = tmp_path_factory.mktemp("hedging")
    (root / "fleet.yaml").write_text(yaml.safe_dump(FLEET))
    slow = _start(root, "slow", HOLD_US, wait_when_idle=True)  # a lone request waits out the delay too
    try:
        fast = _start(root, "fast", 1000)
        try:
            yield slow, fast
        finally:
            fast.stop()
    finally:
        slow.stop()


def _worker_sample(worker: WorkerProcess, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=5).read().decode()
    return sum(value for family in text_string_to_metric_families(text) for sample_name, sample_labels, value, *_
               in family.samples if sample_name == name and all(sample_labels.get(k) == v for k, v in labels.items()))


def _inference_count(worker: WorkerProcess) -> int:
    with grpc.insecure_channel(worker.target) as channel:
        stats = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
            pb.ModelStatisticsRequest(name="m"), timeout=5)
    return sum(model.inference_count for model in stats.model_stats)


@pytest.mark.parametrize("transport", ["uds", "grpc"])
async def test_the_losing_call_is_cancelled_on_its_worker_and_leaves_its_batch(
        workers: tuple[WorkerProcess, WorkerProcess], transport: str) -> None:
    slow, fast = workers
    slow_address, fast_address = (worker.uds_target if transport == "uds" else worker.target for worker in workers)
    metrics, registry = fresh_metrics("inference-router")
    router = Router(connect=connect, metrics=metrics, rng=random.Random(7))
    router.set_model("m", ModelPolicy(slo_p99_ms=40.0, hedge=True, max_attempts=1))
    router.add_replica("m", "1", slow_address)
    router.add_replica("m", "1", fast_address)
    request = encode_request("m", {"features": np.ones((1, 16), np.float32)}).SerializeToString()
    slow_before, fast_before = _inference_count(slow), _inference_count(fast)
    cancelled_before = _worker_sample(slow, "opml_inference_router_worker_uds_requests_total", code="CANCELLED")
    try:
        for _ in range(64):  # P2C picks either first; stop at the first request whose primary was A
            routed = await router.infer("m", "", request, timeout_s=30)
            assert routed.replica == fast_address  # A never answers within a request's life
            if routed.backup_won:
                break
        else:
            pytest.fail("no request had the slow worker as its primary in 64 tries")
        assert sample(registry, "opml_inference_router_backup_requests_total", model="m", version="1") >= 1
        assert sample(registry, "opml_inference_router_backup_wins_total", model="m", version="1") >= 1
        # The loser was cancelled: A's batch queue empties long before its minute is up.
        await wait_until(lambda: _worker_sample(slow, "opml_inference_router_worker_queue_depth", model="m") == 0,
                         timeout_s=30, what="the slow worker to drop the cancelled call")
    finally:
        await router.close()
    if transport == "uds":  # the socket's own CANCEL frame was counted
        assert _worker_sample(slow, "opml_inference_router_worker_uds_requests_total",
                              code="CANCELLED") == cancelled_before + 1
    assert _inference_count(slow) == slow_before  # the cancelled call never ran
    assert _inference_count(fast) > fast_before
