"""Shadow traffic in the router, with fake replicas that answer KServe v2 responses: the caller gets the
stable version's answer only and never waits for the copy, a slow shadow sheds copies instead of
queueing them, failures and latencies of the copies feed the new version's window, and the outputs are
compared as the model config says (class scores, class indexes, values)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from opml_common.errors import InvalidArgument, NotFound
from opml_devstack.testing.bus import fresh_metrics, sample
from opml_inference_router.routing import ModelPolicy, Replica, ReplicaFailed, Router, wire
from opml_inference_router.routing.shadow import Comparison
from opml_inference_router_contract.rollout_spec import CLASSES, SCORES, VALUES

REQUEST = wire.encode_field(wire.MODEL_NAME, "m")
POLICY = ModelPolicy(hedge=False)


def response(values: np.ndarray, name: str = "scores") -> bytes:
    message = pb.ModelInferResponse(model_name="m")
    message.outputs.add(name=name, datatype="FP32" if values.dtype == np.float32 else "INT64", shape=values.shape)
    message.raw_output_contents.append(values.tobytes())
    return message.SerializeToString()


class ScriptedReplica(Replica):
    """Answers ``answer(request)``; ``gate`` (when set) holds every call until it is set."""

    def __init__(self, name: str, answer: Callable[[bytes], bytes], *, gate: asyncio.Event | None = None,
                 fail: ReplicaFailed | None = None) -> None:
        self.name, self.answer, self.gate, self.fail = name, answer, gate, fail
        self.calls: list[bytes] = []
        self.waiting = 0

    async def call(self, method: str, request: bytes, *, timeout_s: float) -> bytes:
        self.calls.append(request)
        if self.gate is not None:
            self.waiting += 1
            try:
                await self.gate.wait()
            finally:
                self.waiting -= 1
        if self.fail is not None:
            raise self.fail
        return self.answer(request)

    async def close(self) -> None:
        return None


def two_versions(stable: ScriptedReplica, new: ScriptedReplica) -> tuple[Router, object]:
    metrics, registry = fresh_metrics("inference-router")
    router = Router(connect={"a:1": stable, "b:1": new}.__getitem__, metrics=metrics, rng=random.Random(1))
    router.set_model("m", POLICY)
    router.add_replica("m", "1", "a:1")
    router.add_replica("m", "2", "b:1")
    return router, registry


async def settled(registry) -> None:
    """Returns once no copy is in flight (each step of a copy is a turn of the loop, no clock)."""
    await asyncio.sleep(0)
    while sample(registry, "opml_inference_router_shadow_in_flight_requests", model="m", version="2"):
        await asyncio.sleep(0)


SCORES_1 = np.array([[0.9, 0.1, 0.0, 0.0]], dtype=np.float32)
SCORES_2 = np.array([[0.1, 0.8, 0.1, 0.0]], dtype=np.float32)


async def test_the_caller_gets_the_stable_answer_and_never_waits_for_the_copy() -> None:
    gate = asyncio.Event()
    stable = ScriptedReplica("a:1", lambda _r: response(SCORES_1))
    new = ScriptedReplica("b:1", lambda _r: response(SCORES_2), gate=gate)
    router, registry = two_versions(stable, new)
    await router.start_shadow("m", "2", 100.0, Comparison("scores", SCORES))
    for _ in range(3):
        routed = await router.infer("m", "", REQUEST, timeout_s=5)  # returns while every copy is held
        assert routed.version == "1" and routed.response == response(SCORES_1)
    await asyncio.sleep(0)
    assert new.waiting == 3 and {wire.read_header(r).model_version for r in new.calls} == {"2"}
    assert sample(registry, "opml_inference_router_shadow_in_flight_requests", model="m", version="2") == 3
    gate.set()
    await settled(registry)
    measures = router.take_shadow_measures("m")
    assert (measures.mirrored, measures.compared, measures.rows, measures.disagreed_rows) == (3, 3, 3, 3)
    assert measures.disagreement == 1.0
    versions = router.take_measures("m")
    assert versions["2"].requests == 3 and versions["2"].errors == 0 and versions["2"].p99_s is not None
    assert sample(registry, "opml_inference_router_shadow_requests_total", model="m", version="2",
                  outcome="answered") == 3
    assert sample(registry, "opml_inference_router_shadow_disagreed_rows_total", model="m", version="2") == 3
    await router.close()


async def test_a_slow_shadow_sheds_copies_beyond_its_bound_instead_of_queueing_them() -> None:
    gate = asyncio.Event()
    stable = ScriptedReplica("a:1", lambda _r: response(SCORES_1))
    new = ScriptedReplica("b:1", lambda _r: response(SCORES_1), gate=gate)
    router, registry = two_versions(stable, new)
    await router.start_shadow("m", "2", 100.0, Comparison("scores", SCORES), max_in_flight=4)
    for _ in range(10):
        assert (await router.infer("m", "", REQUEST, timeout_s=5)).version == "1"
    await asyncio.sleep(0)
    assert new.waiting == 4 and len(new.calls) == 4
    assert sample(registry, "opml_inference_router_shadow_requests_total", model="m", version="2",
                  outcome="shed") == 6
    assert sample(registry, "opml_inference_router_shadow_in_flight_requests", model="m", version="2") == 4
    await router.stop_shadow("m")  # the copies in flight are cancelled: nobody waits for them
    assert new.waiting == 0 and router.take_shadow_measures("m") is None
    gate.set()
    await router.close()


async def test_failed_copies_count_against_the_new_version_and_never_reach_the_caller() -> None:
    stable = ScriptedReplica("a:1", lambda _r: response(SCORES_1))
    new = ScriptedReplica("b:1", lambda _r: b"", fail=ReplicaFailed("INTERNAL", "bad model", retriable=False, eject=False))
    router, registry = two_versions(stable, new)
    await router.start_shadow("m", "2", 100.0, Comparison("scores", SCORES))
    for _ in range(5):
        assert (await router.infer("m", "", REQUEST, timeout_s=5)).version == "1"
    await settled(registry)
    versions = router.take_measures("m")
    assert (versions["1"].requests, versions["1"].errors) == (5, 0)
    assert (versions["2"].requests, versions["2"].errors) == (5, 5)
    measures = router.take_shadow_measures("m")
    assert (measures.mirrored, measures.failed, measures.compared) == (5, 5, 0)
    await router.close()


async def test_a_share_of_the_requests_is_mirrored_and_the_control_plane_checks_its_arguments() -> None:
    stable = ScriptedReplica("a:1", lambda _r: response(SCORES_1))
    new = ScriptedReplica("b:1", lambda _r: response(SCORES_1))
    router, registry = two_versions(stable, new)
    with pytest.raises(InvalidArgument):
        await router.start_shadow("m", "2", 0.0, Comparison("scores", SCORES))
    with pytest.raises(NotFound):
        await router.start_shadow("m", "9", 10.0, Comparison("scores", SCORES))
    await router.start_shadow("m", "2", 25.0, Comparison("scores", SCORES))
    for _ in range(400):
        await router.infer("m", "", REQUEST, timeout_s=5)
    await settled(registry)
    measures = router.take_shadow_measures("m")
    assert 60 <= measures.mirrored <= 140 and measures.disagreed_rows == 0  # ~100 of 400 (seeded)
    await router.close()


@pytest.mark.parametrize(("kind", "new", "stable", "expected"), [
    (SCORES, np.array([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5]], np.float32),
     np.array([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]], np.float32), (3, 1, 0.0)),
    (CLASSES, np.array([[1], [2], [3]], np.int64), np.array([[1], [0], [3]], np.int64), (3, 1, 0.0)),
    (VALUES, np.array([[1.0], [2.0], [10.5]], np.float32), np.array([[1.0], [2.01], [10.0]], np.float32),
     (3, 1, pytest.approx(0.01 / 2.01 + 0.05, rel=1e-4))),
])
def test_rows_compare_as_the_output_description_says(kind, new, stable, expected) -> None:
    assert Comparison("y", kind, tolerance=0.01).rows(response(new, "y"), response(stable, "y")) == expected


def test_outputs_that_do_not_match_are_not_compared() -> None:
    with pytest.raises(InvalidArgument, match="no output 'y'"):
        Comparison("y", SCORES).rows(response(SCORES_1, "scores"), response(SCORES_1, "y"))
    with pytest.raises(InvalidArgument, match="2 rows from the new version, 1 from the stable one"):
        Comparison("y", SCORES).rows(response(np.vstack([SCORES_1, SCORES_1]), "y"), response(SCORES_1, "y"))
