"""Dynamic batching and fixed batch shapes on real onnxruntime sessions (in process, no server)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from prometheus_client import CollectorRegistry

from opml_common.errors import FailedPrecondition, Unavailable
from opml_common.metrics import ServiceMetrics
from opml_inference_router.placement.fleet_config import ModelVersion, PoolKind
from opml_inference_router.runtime import DynamicBatcher, Replica, WorkerMetrics, build_session, to_profile
from opml_inference_router.runtime.metrics import BatchStats
from opml_inference_router.runtime.profiler import profile_replica
from opml_inference_router.testing import mlp_classifier, mlp_config
from opml_inference_router_contract.model_config import ModelConfig

CPU = PoolKind(name="cpu", precisions=("fp32",), memory_mib=4096, slots=4, cost_per_hour=1.0,
               execution_provider="CPUExecutionProvider")
ACCEL = PoolKind(name="accel", precisions=("int8",), memory_mib=512, slots=2, cost_per_hour=0.5,
                 execution_provider="CPUExecutionProvider", batch_sizes=(1, 4, 8))
IN_MEMORY = Path(__file__).parent
"""The external-data folder of the models built here: they hold all their data, so it is never read."""


def replica(kind: PoolKind, *, delay_us: int | None, width: int = 64, depth: int = 2) -> tuple[Replica, bytes]:
    model = mlp_classifier(width=width, depth=depth).SerializeToString()
    config = ModelConfig.from_dict(mlp_config("mlp", max_queue_delay_us=delay_us))
    session = build_session(model, kind, threads=1, source="mlp", folder=IN_MEMORY)
    return Replica(ModelVersion("mlp", 1), config, kind, "fp32", session), model


def batcher_for(served: Replica) -> DynamicBatcher:
    metrics = WorkerMetrics(ServiceMetrics("test", CollectorRegistry()))
    return DynamicBatcher(served, metrics.for_replica("mlp", 1))


def rows(count: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, 16)).astype(np.float32)


async def run_concurrently(batcher: DynamicBatcher, data: np.ndarray) -> np.ndarray:
    await batcher.start()
    try:
        replies = await asyncio.gather(*[batcher.infer({"features": data[i:i + 1]}) for i in range(len(data))])
    finally:
        await batcher.stop()
    return np.concatenate([reply["scores"] for reply in replies])


def test_concurrent_requests_form_batches_with_each_callers_rows() -> None:
    served, model = replica(CPU, delay_us=20_000)
    batcher = batcher_for(served)
    data = rows(24)
    scores = asyncio.run(run_concurrently(batcher, data))
    direct = ort.InferenceSession(model).run(None, {"features": data})[0]
    np.testing.assert_allclose(scores, direct, rtol=1e-5, atol=1e-6)
    counts = batcher.metrics
    assert counts.inference_count == 24
    assert counts.execution_count < 24
    assert max(counts.batches) > 1, counts.batches


def test_without_dynamic_batching_every_request_runs_alone() -> None:
    served, _ = replica(CPU, delay_us=None)
    batcher = batcher_for(served)
    asyncio.run(run_concurrently(batcher, rows(12)))
    assert batcher.metrics.execution_count == 12
    assert set(batcher.metrics.batches) == {1}


def test_batches_never_exceed_the_cap() -> None:
    served, _ = replica(ACCEL, delay_us=50_000)
    batcher = batcher_for(served)
    asyncio.run(run_concurrently(batcher, rows(20)))
    assert served.max_batch == 8
    assert max(batcher.metrics.batches) <= 8
    assert sum(size * stats.count for size, stats in batcher.metrics.batches.items()) == 20


def two_input_replica() -> Replica:
    """``sums = [sum(a), sum(b)]`` per row, on inputs ``a`` and ``b`` whose non-batch dims are both dynamic."""
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["a", "axes"], ["sa"], keepdims=1),
         helper.make_node("ReduceSum", ["b", "axes"], ["sb"], keepdims=1),
         helper.make_node("Concat", ["sa", "sb"], ["sums"], axis=1)], "two",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", "da"]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["batch", "db"])],
        [helper.make_tensor_value_info("sums", TensorProto.FLOAT, ["batch", 2])],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    config = ModelConfig.from_dict({
        **mlp_config("two", max_queue_delay_us=50_000),
        "inputs": [{"name": "a", "data_type": "fp32", "dims": [-1]}, {"name": "b", "data_type": "fp32", "dims": [-1]}],
        "outputs": [{"name": "sums", "data_type": "fp32", "dims": [2]}]})
    session = build_session(model.SerializeToString(), CPU, threads=1, source="two", folder=IN_MEMORY)
    return Replica(ModelVersion("two", 1), config, CPU, "fp32", session)


def test_requests_listing_their_inputs_in_another_order_are_batched_by_name() -> None:
    """``a:[1,3], b:[1,5]`` and ``b:[1,3], a:[1,5]`` list the same shapes in order but differ by name:
    they must not share a batch (joined by name, they cannot be), and each gets its own sums."""
    batcher = batcher_for(two_input_replica())
    first = {"a": np.ones((1, 3), np.float32), "b": np.ones((1, 5), np.float32)}
    second = {"b": np.ones((1, 3), np.float32), "a": np.ones((1, 5), np.float32)}
    same_as_first = {"b": np.full((1, 5), 2, np.float32), "a": np.full((1, 3), 2, np.float32)}

    async def serve() -> tuple[list[dict[str, np.ndarray]], int, list[dict[str, np.ndarray]], int]:
        await batcher.start()
        try:
            swapped = await asyncio.gather(batcher.infer(first), batcher.infer(second))
            runs = batcher.metrics.execution_count
            alike = await asyncio.gather(batcher.infer(first), batcher.infer(same_as_first))
            return swapped, runs, alike, batcher.metrics.execution_count - runs
        finally:
            await batcher.stop()

    swapped, swapped_runs, alike, alike_runs = asyncio.run(serve())
    assert [reply["sums"].tolist() for reply in swapped] == [[[3.0, 5.0]], [[5.0, 3.0]]]
    assert swapped_runs == 2
    assert [reply["sums"].tolist() for reply in alike] == [[[3.0, 5.0]], [[6.0, 10.0]]]
    assert alike_runs == 1  # same shapes by name, listed in another order: one batch


def test_fixed_shapes_pad_and_drop_the_padding() -> None:
    served, model = replica(ACCEL, delay_us=None)
    assert [served.padded(n) for n in (1, 2, 4, 5, 8)] == [1, 4, 4, 8, 8]
    data = rows(5)
    outputs = served.run({"features": data})["scores"]
    assert outputs.shape == (5, 4)
    np.testing.assert_allclose(outputs, ort.InferenceSession(model).run(None, {"features": data})[0],
                               rtol=1e-5, atol=1e-6)


class GatedReplica(Replica):
    """A real replica whose first batch runs only once ``gate`` is set: the replica is busy until then."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.started = threading.Event()
        self.ran: list[int] = []  # requests per batch run, in order

    def run_batch(self, requests):
        self.started.set()
        self.gate.wait()
        self.ran.append(len(requests))
        return super().run_batch(requests)


def gated_replica(*, delay_us: int) -> GatedReplica:
    model = mlp_classifier(width=64, depth=2).SerializeToString()
    config = ModelConfig.from_dict(mlp_config("mlp", max_queue_delay_us=delay_us))
    return GatedReplica(ModelVersion("mlp", 1), config, CPU, "fp32",
                        build_session(model, CPU, threads=1, source="mlp", folder=IN_MEMORY))


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.001)


def test_a_cancelled_request_leaves_the_queue_at_once_and_never_runs() -> None:
    """A hedged request that lost (or a caller past its deadline) frees its place in the forming
    batch when it is cancelled, not when the batch is taken."""
    served = gated_replica(delay_us=10_000_000)  # the batch would wait 10 s to fill: it must not matter
    batcher = batcher_for(served)
    depth = batcher.metrics.queue_depth._value

    async def scenario() -> None:
        await batcher.start()
        try:
            busy = asyncio.create_task(batcher.infer({"features": rows(1)}))  # the replica was idle: it runs
            await until(served.started.is_set)
            doomed = asyncio.create_task(batcher.infer({"features": rows(3)}))  # behind it: a batch forms
            await until(lambda: depth.get() >= 1)
            doomed.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await doomed
            assert depth.get() == 0 and batcher._queued_rows == 0
            served.gate.set()
            await busy
            batcher.set_max_batch(2)  # a live request of 2 rows fills the batch: it runs at once
            kept = await batcher.infer({"features": rows(2)})
            assert kept["scores"].shape == (2, 4)
        finally:
            served.gate.set()
            await batcher.stop()

    asyncio.run(scenario())
    assert served.ran == [1, 1]  # the busy request, then the kept one: the cancelled one never ran
    assert batcher.metrics.inference_count == 3 and batcher.metrics.execution_count == 2
    assert depth.get() == 0


def test_a_stop_while_a_batch_runs_answers_its_callers_and_runs_what_is_queued() -> None:
    """A version rolled back under load: its replica stops while a batch runs (on the dispatcher
    itself, one instance) and more wait behind it. Every caller gets its answer; none waits out its
    deadline for a result that never comes."""
    served = gated_replica(delay_us=10_000_000)
    batcher = batcher_for(served)
    depth = batcher.metrics.queue_depth._value

    async def scenario() -> list[dict]:
        await batcher.start()
        running = asyncio.create_task(batcher.infer({"features": rows(1)}))
        await until(served.started.is_set)
        queued = asyncio.create_task(batcher.infer({"features": rows(2)}))  # would wait 10 s for a batch
        await until(lambda: depth.get() == 1)
        stopping = asyncio.create_task(batcher.stop())
        await until(lambda: batcher._closed)
        served.gate.set()
        await stopping
        return [await running, await queued]

    answers = asyncio.run(scenario())
    assert [answer["scores"].shape for answer in answers] == [(1, 4), (2, 4)]
    assert served.ran == [1, 1]  # the running request, then the queued one: not held for a batch to grow


def test_a_stop_that_is_itself_cancelled_fails_the_running_batch_instead_of_leaving_it_unanswered() -> None:
    served = gated_replica(delay_us=None)
    batcher = batcher_for(served)

    async def scenario() -> None:
        await batcher.start()
        running = asyncio.create_task(batcher.infer({"features": rows(1)}))
        await until(served.started.is_set)
        stopping = asyncio.create_task(batcher.stop())
        await until(lambda: batcher._closed)
        stopping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stopping
        with pytest.raises(Unavailable, match="unloaded while running"):
            await running
        served.gate.set()

    asyncio.run(scenario())


def test_a_request_finding_the_replica_idle_runs_without_waiting_the_delay() -> None:
    """Nothing queued, nothing running: there is no batch to wait for, so the queue delay (a minute
    here) is not paid; the request takes whatever arrived with it."""
    served, _ = replica(CPU, delay_us=60_000_000)
    batcher = batcher_for(served)

    async def scenario() -> None:
        await batcher.start()
        try:
            alone = await asyncio.wait_for(batcher.infer({"features": rows(1)}), timeout=30)
            assert alone["scores"].shape == (1, 4)
            together = await asyncio.wait_for(asyncio.gather(
                *[batcher.infer({"features": rows(1, seed)}) for seed in range(3)]), timeout=30)
            assert len(together) == 3
        finally:
            await batcher.stop()

    asyncio.run(scenario())
    assert batcher.metrics.execution_count == 2 and sorted(batcher.metrics.batches) == [1, 3]


def test_wait_when_idle_holds_a_lone_request_for_its_batch_as_triton_does() -> None:
    config = ModelConfig.from_dict({**mlp_config("mlp"),
                                    "dynamic_batching": {"max_queue_delay_us": 60_000_000, "wait_when_idle": True}})
    session = build_session(mlp_classifier().SerializeToString(), CPU, threads=1, source="mlp", folder=IN_MEMORY)
    batcher = batcher_for(Replica(ModelVersion("mlp", 1), config, CPU, "fp32", session))
    depth = batcher.metrics.queue_depth._value

    async def scenario() -> None:
        await batcher.start()
        try:
            held = asyncio.create_task(batcher.infer({"features": rows(1)}))
            await until(lambda: depth.get() == 1)
            for _ in range(20):  # the dispatcher runs, and waits for the batch to fill
                await asyncio.sleep(0)
            assert depth.get() == 1 and batcher.metrics.execution_count == 0
            batcher.set_max_batch(1)  # now the one row fills it
            assert (await held)["scores"].shape == (1, 4)
        finally:
            await batcher.stop()

    asyncio.run(scenario())
    assert batcher.metrics.execution_count == 1


def test_requests_arriving_while_the_replica_runs_form_one_batch() -> None:
    """Under load the delay still does its work: what queues behind a running batch is taken together."""
    served = gated_replica(delay_us=20_000)
    batcher = batcher_for(served)
    depth = batcher.metrics.queue_depth._value

    async def scenario() -> None:
        await batcher.start()
        try:
            first = asyncio.create_task(batcher.infer({"features": rows(1)}))
            await until(served.started.is_set)
            behind = [asyncio.create_task(batcher.infer({"features": rows(1, seed)})) for seed in range(5)]
            await until(lambda: depth.get() == 5)
            served.gate.set()
            await asyncio.gather(first, *behind)
        finally:
            served.gate.set()
            await batcher.stop()

    asyncio.run(scenario())
    assert served.ran == [1, 5]


def test_profile_grows_with_batch_size_and_converts_to_placement_profile() -> None:
    served, _ = replica(CPU, delay_us=1000, width=512, depth=3)
    served.memory_mib = 3.5
    report = profile_replica(served, repeats=15, budget_s=0.5)
    assert [t.batch for t in report.timings] == [1, 2, 4, 8, 16, 32]
    assert report.timings[-1].p50_ms > 1.5 * report.timings[0].p50_ms, report.timings
    assert all(t.p99_ms >= t.p50_ms > 0 for t in report.timings)
    profile = to_profile(report)
    latencies = [profile.batch_latency_ms[size] for size in (1, 2, 4, 8, 16, 32)]
    assert latencies == sorted(latencies)
    assert (profile.pool_kind, profile.precision, profile.memory_mib) == ("cpu", "fp32", 3.5)


def test_profile_on_a_fixed_shape_kind_measures_its_shapes() -> None:
    served, _ = replica(ACCEL, delay_us=1000)
    served.memory_mib = 1.0
    assert [t.batch for t in profile_replica(served, repeats=3).timings] == [1, 4, 8]


class CountingReplica(Replica):
    """A real replica that counts how many of its kind run a batch at the same moment."""

    running = 0
    peak = 0
    lock = threading.Lock()

    def run_batch(self, requests):
        with CountingReplica.lock:
            CountingReplica.running += 1
            CountingReplica.peak = max(CountingReplica.peak, CountingReplica.running)
        try:
            time.sleep(0.03)  # long enough that every free instance gets a batch meanwhile
            return super().run_batch(requests)
        finally:
            with CountingReplica.lock:
                CountingReplica.running -= 1


def counting_instances(count: int) -> list[Replica]:
    model = mlp_classifier(width=16, depth=1).SerializeToString()
    config = ModelConfig.from_dict(mlp_config("mlp", max_queue_delay_us=None))
    return [CountingReplica(ModelVersion("mlp", 1), config, CPU, "fp32",
                            build_session(model, CPU, threads=1, source="mlp", folder=IN_MEMORY))
            for _ in range(count)]


def peak_concurrency(instances: list[Replica], requests: int, *, retire: int = 0) -> tuple[int, int]:
    """(most batches running at once, batches run) for ``requests`` concurrent one-row requests."""
    CountingReplica.running = CountingReplica.peak = 0
    batcher = batcher_for(instances[0])
    for instance in instances[1:]:
        batcher.add_instance(instance)

    async def scenario() -> None:
        await batcher.start()
        try:
            if retire:
                assert len(await batcher.retire(retire)) == retire
            data = rows(requests)
            replies = await asyncio.gather(*[batcher.infer({"features": data[i:i + 1]}) for i in range(requests)])
            expected = instances[0].run({"features": data})["scores"]
            np.testing.assert_allclose(np.concatenate([r["scores"] for r in replies]), expected, rtol=1e-5, atol=1e-6)
        finally:
            await batcher.stop()

    asyncio.run(scenario())
    return CountingReplica.peak, batcher.metrics.execution_count


def test_k_instances_run_k_batches_at_once() -> None:
    assert peak_concurrency(counting_instances(1), 6) == (1, 6)
    assert peak_concurrency(counting_instances(3), 6) == (3, 6)  # three sessions, three batches in flight
    assert peak_concurrency(counting_instances(3), 6, retire=2) == (1, 6)  # retired instances take no batch


def test_the_batch_cap_changes_while_serving() -> None:
    served, _ = replica(CPU, delay_us=50_000)
    batcher = batcher_for(served)

    async def scenario() -> list[int]:
        await batcher.start()
        try:
            data = rows(8)
            batcher.set_max_batch(2)
            await asyncio.gather(*[batcher.infer({"features": data[i:i + 1]}) for i in range(8)])
            batcher.set_max_batch(1000)  # capped at the replica's own cap
            assert batcher.max_batch == served.max_batch
            return sorted(batcher.metrics.batches)
        finally:
            await batcher.stop()

    assert asyncio.run(scenario()) == [2]


async def measured(batcher: DynamicBatcher) -> None:
    """Runs requests through the queue until the batcher knows its runs are short (a session's first
    runs are slower): then it may run requests in place."""
    for seed in range(1000):
        if batcher.can_run_now():
            return
        await batcher.infer({"features": rows(1, seed)})
    raise AssertionError("runs of a 64-wide MLP never averaged under the inline bound")


def test_an_idle_replica_runs_requests_in_place_as_the_batch_they_would_make() -> None:
    """run_now: no queue, no future, the same answers and the same statistics as infer(); only when
    can_run_now says so (runs known to be short, nothing queued or running) and they fit one batch."""
    served, model = replica(CPU, delay_us=20_000)
    batcher = batcher_for(served)
    data = rows(4)
    counts = batcher.metrics

    async def scenario() -> None:
        await batcher.start()
        try:
            assert not batcher.can_run_now()  # no run measured yet: the first goes through the queue
            await measured(batcher)
            before = (counts.inference_count, counts.execution_count, counts.batches.get(3, BatchStats()).count)
            first = await batcher.infer({"features": data[:1]})
            second, third = batcher.run_now([{"features": data[1:2]}, {"features": data[2:]}])
            direct = ort.InferenceSession(model).run(None, {"features": data})[0]
            np.testing.assert_allclose(np.concatenate([first["scores"], second["scores"], third["scores"]]),
                                       direct, rtol=1e-5, atol=1e-6)
            # the two requests run in place made one batch of their 3 rows
            assert (counts.inference_count, counts.execution_count, counts.batches[3].count) == (
                before[0] + 4, before[1] + 2, before[2] + 1)
            assert not batcher.fits_one_batch([{"features": rows(20)}, {"features": rows(20)}])  # 40 > the cap
            with pytest.raises(FailedPrecondition):
                batcher.run_now([{"features": rows(20)}, {"features": rows(20)}])
        finally:
            await batcher.stop()
        assert not batcher.can_run_now()  # stopped

    asyncio.run(scenario())


def test_a_replica_running_a_batch_is_not_run_in_place() -> None:
    served = gated_replica(delay_us=20_000)
    batcher = batcher_for(served)

    async def scenario() -> None:
        await batcher.start()
        try:
            running = asyncio.create_task(batcher.infer({"features": rows(1)}))  # on its thread, at the gate
            await until(served.started.is_set)
            assert not batcher.can_run_now()
            with pytest.raises(FailedPrecondition):
                batcher.run_now([{"features": rows(1)}])
            served.gate.set()
            await running
        finally:
            served.gate.set()
            await batcher.stop()

    asyncio.run(scenario())
    assert served.ran == [1]
