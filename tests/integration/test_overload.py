"""A burst of ten times a model's capacity for 30 s against the router as its own process (issue 12,
item 4): admitted requests keep the model's SLO, every other one gets RESOURCE_EXHAUSTED at once, the
router's memory stays within a bound of its value before the burst (its queue's bytes plus what gRPC
holds of requests the event loop has not reached yet, at most about a second of the burst's arrivals),
and it serves normally after.

Capacity is measured first in the same run (closed loop, tritonclient's aio client), so the burst is
ten times what this machine serves, however fast or loaded it is. The model is made slow on purpose
(1,024 rows of a 1,024-wide MLP per request, no batching: tens of ms per call), so ten times its
capacity is a few hundred requests a second, which one Python load generator sends without falling
behind on two shared cores. The same numbers are in docs/benchmarks.md (faults).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import numpy as np
import psutil
import pytest
import tritonclient.grpc as triton_sync
import tritonclient.grpc.aio as triton
from opml.inference.v1 import deployments_pb2 as pb
from tritonclient.utils import InferenceServerException

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import NotFound
from opml_devstack.testing.bus import poll_until
from opml_devstack.testing.services import TOKENS
from opml_inference_router.testing import mlp_classifier, mlp_config, write_model_dir
from opml_inference_router_contract.client import DeploymentClient

SLO_MS = 1000.0
ROWS = 1024
BURST_S = 30.0
# The router's RSS may grow by at most this much over its value before the burst: its queue holds at most
# 256 waiting requests per model (16 MiB of these 64 KiB requests), plus gRPC's buffers for those in flight
# and the allocator's slack...
RSS_BOUND_MIB = 64.0
# ...plus the requests gRPC's core receives while the event loop is busy (it reads every stream as it comes,
# before the loop refuses it): up to this long a stall of the loop at the burst's rate. On a CI machine whose
# capacity is twice this one's, the burst (576 req/s, 36 MiB/s) grew the RSS by 79 MiB; a bound that does not
# scale with the rate fails a faster machine, not a leak. Growth with the burst's duration would still fail.
STALL_S = 1.0
REQUEST_MIB = ROWS * 16 * 4 / 2**20
HEADERS = {"authorization": f"Bearer {TOKENS['writer']}"}


def _deploy(serving_stack, tmp_path) -> None:
    config = mlp_config("heavy", max_batch_size=ROWS, max_queue_delay_us=None, pool_kinds=("cpu",),
                        precisions=("fp32",), p99_ms=SLO_MS)
    model_dir = write_model_dir(tmp_path / "heavy", config, mlp_classifier(width=1024, depth=3, seed=5))
    with BundleStoreClient(serving_stack.store.target, token=TOKENS["writer"]) as store, \
            DeploymentClient(serving_stack.router.target, token=TOKENS["reader"]) as deployments:
        store.create_context("overload")
        store.add("overload", "heavy", {"model.onnx": model_dir / "model.onnx", "model.yaml": model_dir / "model.yaml"},
                  tags={"serve": "true"}, commit=True)

        def serving() -> bool:
            try:
                return any(v.state == pb.SERVING for v in deployments.get("heavy").versions)
            except NotFound:
                return False
        poll_until(serving, timeout_s=120, what="the heavy model serving")


def _inputs() -> list[triton.InferInput]:
    data = np.random.default_rng(0).standard_normal((ROWS, 16)).astype(np.float32)
    tensor = triton.InferInput("features", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    return [tensor]


async def _one(client: triton.InferenceServerClient, inputs, outcomes: list[tuple[str, float]]) -> None:
    began = time.perf_counter()
    try:
        await client.infer("heavy", inputs, headers=HEADERS)
        outcomes.append(("OK", time.perf_counter() - began))
    except InferenceServerException as exc:
        outcomes.append((exc.status(), time.perf_counter() - began))


async def _capacity(client: triton.InferenceServerClient, inputs, *, callers: int, requests: int) -> float:
    """Requests per second served by ``callers`` closed-loop callers (all must succeed)."""
    outcomes: list[tuple[str, float]] = []
    left = iter(range(requests))

    async def caller() -> None:
        for _ in left:
            await _one(client, inputs, outcomes)
    began = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    elapsed = time.perf_counter() - began
    assert {code for code, _ in outcomes} == {"OK"}, Counter(code for code, _ in outcomes)
    return requests / elapsed


async def _burst(client: triton.InferenceServerClient, inputs, *, rate: float, seconds: float,
                 rss: list[float], router: psutil.Process) -> tuple[list[tuple[str, float]], float]:
    """Open loop: one request every 1/rate s for ``seconds`` (sent on schedule, never waiting for
    answers); the router's RSS sampled as it goes. Returns the outcomes and the rate really sent."""
    outcomes: list[tuple[str, float]] = []
    tasks: list[asyncio.Task] = []
    began = time.perf_counter()
    count = int(rate * seconds)
    for index in range(count):
        wait = began + index / rate - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)  # pacing the generator, not synchronising the test
        tasks.append(asyncio.create_task(_one(client, inputs, outcomes)))
        if index % max(1, int(rate / 4)) == 0:
            rss.append(router.memory_info().rss / 2**20)
    sent_rate = count / (time.perf_counter() - began)
    await asyncio.gather(*tasks)
    rss.append(router.memory_info().rss / 2**20)
    return outcomes, sent_rate


@pytest.mark.machine_to_itself  # the burst's latencies are measured on two cores: no other test's load beside it
async def test_a_burst_of_ten_times_capacity_keeps_the_slo_for_the_admitted_and_bounded_memory(
        serving_stack, tmp_path) -> None:
    _deploy(serving_stack, tmp_path)
    router = psutil.Process(serving_stack.router.process.pid)
    inputs = _inputs()
    client = triton.InferenceServerClient(serving_stack.router.target)
    try:
        await _capacity(client, inputs, callers=4, requests=20)  # warm-up: the router learns the service time
        capacity = await _capacity(client, inputs, callers=8, requests=80)
        before = router.memory_info().rss / 2**20
        rss: list[float] = []
        outcomes, sent_rate = await _burst(client, inputs, rate=10 * capacity, seconds=BURST_S, rss=rss,
                                           router=router)
        codes = Counter(code for code, _ in outcomes)
        served = sorted(seconds for code, seconds in outcomes if code == "OK")
        report = (f"capacity {capacity:.0f} req/s, burst sent at {sent_rate:.0f} req/s for {BURST_S:.0f} s: {dict(codes)}; "
                  f"admitted p99 {np.percentile(served, 99) * 1000:.0f} ms (SLO {SLO_MS:.0f} ms); router RSS "
                  f"{before:.0f} MiB before, {max(rss):.0f} MiB at most (bound +{RSS_BOUND_MIB + STALL_S * sent_rate * REQUEST_MIB:.0f})")
        print(report)  # shown with -s, and in docs/benchmarks.md (faults)
        assert sent_rate >= 5 * capacity, report  # the burst really was several times capacity
        assert set(codes) <= {"OK", "StatusCode.RESOURCE_EXHAUSTED"}, report
        assert codes["StatusCode.RESOURCE_EXHAUSTED"] >= 0.5 * len(outcomes), report
        assert codes["OK"] >= 0.5 * capacity * BURST_S, report  # still serving near capacity throughout
        assert np.percentile(served, 99) * 1000 <= SLO_MS, report
        assert max(rss) - before <= RSS_BOUND_MIB + STALL_S * sent_rate * REQUEST_MIB, report
        await _one(client, inputs, outcomes)  # after the burst: served at once
        assert outcomes[-1][0] == "OK"
    finally:
        await client.close()
    with triton_sync.InferenceServerClient(serving_stack.router.target) as sync_client:
        assert sync_client.is_model_ready("heavy", headers=HEADERS)
