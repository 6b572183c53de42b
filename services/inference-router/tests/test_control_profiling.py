"""Profiling measures the real request path (issue 12, item 2): on a real worker process, the batch
latencies the router plans with are those of one-row requests sent over its own connection, far above
the model's execution alone for a small model, and the first placement is made on them."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from opml_common.metrics import ServiceMetrics
from opml_inference_router.control import Source
from opml_inference_router.control.profiling import request_path_profile
from opml_inference_router.control.state import VersionRecord
from opml_inference_router.control.workers import WorkerClient
from opml_inference_router.routing import Router
from opml_inference_router.routing.uds_replica import connect
from opml_inference_router.testing import mlp_config, write_model_dir
from opml_inference_router.worker import WorkerProcess
from opml_inference_router_contract.model_config import ModelConfig

FLEET = {"pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 4096, "slots": 2,
                         "cost_per_hour": 1.0, "execution_provider": "CPUExecutionProvider"}],
         "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}]}


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    root = tmp_path_factory.mktemp("profiling")
    (root / "fleet.yaml").write_text(yaml.safe_dump(FLEET))
    process = WorkerProcess("cpu", root / "fleet.yaml", root / "worker.log", env={"OPML_LOG_FORMAT": "text"},
                            uds=root / "worker.sock").start()
    try:
        yield process
    finally:
        process.stop()


@pytest.mark.parametrize("transport", ["uds", "grpc"])
async def test_the_profile_is_the_request_paths_not_the_models_alone(worker: WorkerProcess, tmp_path: Path,
                                                                    transport: str) -> None:
    config = mlp_config("small", pool_kinds=("cpu",), precisions=("fp32",))
    directory = write_model_dir(tmp_path / "small", config)
    entry = VersionRecord(1, Source(model_dir=str(directory)), str(directory), config=ModelConfig.from_dict(config))
    client = WorkerClient(worker.target)
    router = Router(connect=connect, metrics=ServiceMetrics("inference-router", registry=CollectorRegistry()),
                    rng=random.Random(1))
    try:
        await client.load("small", path=directory, version=1, profile=True)
        executed = await client.profile("small", 1)
        async with router.connection(worker.local_target if transport == "uds" else worker.target) as replica:
            path = await request_path_profile(replica, client, entry.config, entry, executed, repeats=4)
        await client.unload("small", 1)
    finally:
        await client.close()
        await router.close()
    sizes = sorted(executed.batch_latency_ms)
    assert sorted(path.batch_latency_ms) == sizes == [1, 2, 4, 8, 16, 32]
    latencies = [path.latency_ms(size) for size in sizes]
    assert latencies == sorted(latencies)
    assert all(path.latency_ms(size) >= executed.latency_ms(size) for size in sizes)
    # A 64-wide MLP runs a row in microseconds; decoding, encoding, copies and the hop cost far more.
    assert path.latency_ms(1) > 3 * executed.latency_ms(1), (path.batch_latency_ms, executed.batch_latency_ms)
    assert (path.model, path.pool_kind, path.precision, path.memory_mib) == (
        executed.model, executed.pool_kind, executed.precision, executed.memory_mib)
