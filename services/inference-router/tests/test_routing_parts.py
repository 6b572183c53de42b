"""Unit tests of the routing building blocks: wire header, latency window, replica choice,
admission, traffic split. Pure logic, no network."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from tritonclient.grpc import service_pb2

from opml_common.errors import InvalidArgument
from opml_inference_router.routing import ConcurrencyLimiter, LatencyWindow, ReplicaSet, Shed, TrafficSplit, wire
from opml_inference_router.routing.errors import ReplicaFailed
from opml_inference_router.routing.replicas import Replica


class _Named(Replica):
    def __init__(self, name: str) -> None:
        self.name = name

    async def call(self, method: str, request: bytes, *, timeout_s: float) -> bytes:  # pragma: no cover
        raise NotImplementedError

    async def close(self) -> None:  # pragma: no cover
        pass


# -- replica errors -----------------------------------------------------------------------------

@pytest.mark.parametrize(("code", "message", "expected"), [
    ("UNAVAILABLE", "connection reset", ("UNAVAILABLE", "connection reset", True, True)),
    ("NOT_FOUND", "", ("NOT_FOUND", "NOT_FOUND", True, True)),
    ("RESOURCE_EXHAUSTED", "busy", ("RESOURCE_EXHAUSTED", "busy", True, False)),
    ("INVALID_ARGUMENT", "inputs[x]: bad", ("INVALID_ARGUMENT", "inputs[x]: bad", False, False)),
    ("PERMISSION_DENIED", "no", ("UNAVAILABLE", "a worker refused the router's credentials; see the router's logs",
                                 True, True)),
])
def test_a_workers_status_decides_retry_and_ejection_the_same_for_every_transport(
        code: str, message: str, expected: tuple[str, str, bool, bool]) -> None:
    failure = ReplicaFailed.of_status(code, message, replica="w1")
    assert (failure.code, failure.message, failure.retriable, failure.eject) == expected
    assert failure.replica == "w1"


# -- wire ---------------------------------------------------------------------------------------

def _request(**fields: str) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(**fields)
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[2, 3])
    tensor.parameters["p"].int64_param = 7
    request.raw_input_contents.append(bytes(range(24)))
    return request


def test_read_header_finds_name_version_and_id_among_tensors() -> None:
    data = _request(model_name="resnet", model_version="3", id="req-9").SerializeToString()
    assert wire.read_header(data) == ("resnet", "3", "req-9")
    assert wire.read_header(_request(model_name="m").SerializeToString()) == ("m", "", "")


def test_with_field_overrides_the_version_without_touching_tensors() -> None:
    original = _request(model_name="m", model_version="1")
    amended = service_pb2.ModelInferRequest.FromString(
        wire.with_field(original.SerializeToString(), wire.MODEL_VERSION, "2"))
    assert amended.model_version == "2"
    amended.model_version = "1"
    assert amended == original


@pytest.mark.parametrize(("response", "leads"), [
    (service_pb2.ModelInferResponse(model_name="m", model_version="2", id="r"), True),
    (service_pb2.ModelInferResponse(model_version="2"), True),
    (service_pb2.ModelInferResponse(model_name="m", id="r"), False),
    (service_pb2.ModelInferResponse(), False),
])
def test_version_leads_tells_whether_a_response_names_its_version(
        response: service_pb2.ModelInferResponse, leads: bool) -> None:
    data = response.SerializeToString()
    assert wire.version_leads(data) is leads
    if not leads:  # then the router appends it
        amended = wire.with_field(data, wire.MODEL_VERSION, "5")
        assert service_pb2.ModelInferResponse.FromString(amended).model_version == "5"


@pytest.mark.parametrize("data", [b"\x0a\x05ab", b"\x0b", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"])
def test_read_header_refuses_malformed_bytes(data: bytes) -> None:
    with pytest.raises(wire.MalformedMessage):
        wire.read_header(data)


# -- latency window ------------------------------------------------------------------------------

def test_latency_window_quantiles_follow_recent_samples() -> None:
    window = LatencyWindow(size=100, refresh=10, min_samples=10)
    for value in range(9):
        window.observe(value)
    assert window.p95 is None
    window.observe(9)
    assert window.p50 == 4 and window.p95 == 9
    for _ in range(100):
        window.observe(0.5)  # the old samples roll out of the ring
    assert window.p50 == window.p95 == 0.5


# -- replica choice ------------------------------------------------------------------------------

def _set(names: list[str], policy: str = "p2c", now: list[float] | None = None) -> ReplicaSet:
    clock = now if now is not None else [0.0]
    replicas = ReplicaSet(policy=policy, eject_s=1.0, max_eject_s=4.0, clock=lambda: clock[0], rng=random.Random(1))
    for name in names:
        replicas.add(_Named(name))
    return replicas


def test_power_of_two_choices_never_picks_the_most_loaded_and_favours_the_least() -> None:
    replicas = _set(["a", "b", "c", "d"])
    for load, state in enumerate(replicas):
        state.outstanding = load * 10
    picks = Counter(replicas.pick().name for _ in range(4000))
    assert picks["d"] == 0
    assert picks["a"] > picks["b"] > picks["c"] > 0
    assert picks["a"] == pytest.approx(4000 * 3 / 6, rel=0.1)  # a wins every pair it is in: 3 of 6 pairs


def test_least_outstanding_picks_the_minimum_and_respects_exclusion() -> None:
    replicas = _set(["a", "b", "c"], policy="least")
    a, b, c = list(replicas)
    a.outstanding, b.outstanding, c.outstanding = 5, 1, 3
    assert replicas.pick() is b
    assert replicas.pick(exclude=[b]) is c
    assert replicas.pick(exclude=[a, b, c]) is None


def test_ejection_backs_off_and_ends_with_success_and_panics_when_all_are_out() -> None:
    now = [0.0]
    replicas = _set(["a", "b"], now=now)
    a, b = list(replicas)
    replicas.failed(a, eject=True)
    assert {replicas.pick().name for _ in range(50)} == {"b"}
    assert replicas.ready_count() == 1
    now[0] = 1.01
    assert replicas.ready_count() == 2
    replicas.failed(a, eject=True)  # second failure in a row: 2 s
    now[0] = 2.5
    assert replicas.ready_count() == 1
    replicas.failed(b, eject=True)
    assert replicas.pick() is not None  # every replica ejected: choose anyway
    replicas.succeeded(a, 0.01)
    assert a.ejected_until == 0.0 and a.failures == 0
    replicas.failed(b, eject=False)  # a busy replica is not ejected
    assert b.failures == 1


def test_removed_replica_leaves_rotation() -> None:
    replicas = _set(["a", "b"])
    assert replicas.remove("a").removed
    assert replicas.remove("zzz") is None
    assert {replicas.pick().name for _ in range(20)} == {"b"}


# -- admission -----------------------------------------------------------------------------------

async def test_limiter_queues_in_order_and_hands_slots_over() -> None:
    limiter = ConcurrencyLimiter(limit=2, max_queue=2, name="m")
    assert limiter.try_acquire() and limiter.try_acquire()
    order: list[int] = []

    async def wait(index: int) -> None:
        await limiter.acquire(time_left_s=5, expected_s=0.001)
        order.append(index)

    waiters = [asyncio.create_task(wait(i)) for i in range(2)]
    await asyncio.sleep(0.01)
    assert limiter.waiting == 2
    with pytest.raises(Shed) as shed:
        await limiter.acquire(time_left_s=5, expected_s=0.001)
    assert shed.value.reason == "queue_full" and shed.value.code == "RESOURCE_EXHAUSTED"
    limiter.release()
    limiter.release()
    await asyncio.gather(*waiters)
    assert order == [0, 1] and limiter.in_flight == 2
    limiter.release()
    limiter.release()
    assert limiter.in_flight == 0


async def test_limiter_sheds_what_cannot_meet_its_deadline() -> None:
    limiter = ConcurrencyLimiter(limit=1, max_queue=10, name="m")
    assert limiter.try_acquire()
    with pytest.raises(Shed) as shed:  # expected wait 1 x 50 ms + 50 ms service > 60 ms left
        await limiter.acquire(time_left_s=0.06, expected_s=0.05)
    assert shed.value.reason == "deadline"
    with pytest.raises(Shed) as shed:  # admitted to the queue, but no slot frees up in time
        await limiter.acquire(time_left_s=0.05, expected_s=0.01)
    assert shed.value.reason == "deadline" and limiter.waiting == 0


async def test_limiter_keeps_admitted_requests_within_the_slo_whatever_their_deadline() -> None:
    """A caller with a generous deadline still only waits while the SLO allows: past it, shed as ``slo``."""
    limiter = ConcurrencyLimiter(limit=1, max_queue=10, name="m", slo_s=0.08)
    assert limiter.try_acquire()
    with pytest.raises(Shed) as shed:  # 50 ms expected wait + 50 ms service > the 80 ms SLO, deadline 10 s
        await limiter.acquire(time_left_s=10.0, expected_s=0.05)
    assert shed.value.reason == "slo" and "SLO (p99 80.0 ms)" in str(shed.value)
    limiter.resize(limit=1, max_queue=10, slo_s=0.05)
    with pytest.raises(Shed) as shed:  # queued, but no slot frees up within the SLO's budget
        await limiter.acquire(time_left_s=10.0, expected_s=0.01)
    assert shed.value.reason == "slo" and limiter.waiting == 0
    limiter.resize(limit=1, max_queue=10, slo_s=1.0)
    with pytest.raises(Shed) as shed:  # the deadline comes first: it is the deadline that sheds
        await limiter.acquire(time_left_s=0.06, expected_s=0.05)
    assert shed.value.reason == "deadline"


async def test_a_standing_queue_serves_its_newest_waiter_first() -> None:
    """Adaptive LIFO: in arrival order while waits are short; once the oldest waiter has used a quarter of
    its budget, the newest goes first (it makes the SLO; the oldest run out of budget and are shed)."""
    now = [0.0]
    limiter = ConcurrencyLimiter(limit=1, max_queue=10, name="m", clock=lambda: now[0])
    assert limiter.try_acquire()
    order: list[str] = []

    async def wait(name: str) -> None:
        await limiter.acquire(time_left_s=100.0, expected_s=0.001)  # a budget of ~100 s: no timer fires
        order.append(name)
    waiters = [asyncio.create_task(wait(name)) for name in "abcd"]
    while limiter.waiting < 4:
        await asyncio.sleep(0)
    limiter.release()  # t=0: nobody has waited long, first come first served
    await waiters[0]
    now[0] = 30.0  # the oldest waiter (b) has used more than a quarter of its budget: a standing queue
    limiter.release()
    await waiters[3]
    limiter.release()
    await waiters[2]
    assert order == ["a", "d", "c"] and limiter.waiting == 1
    limiter.release()
    await waiters[1]
    limiter.release()
    assert limiter.in_flight == 0


async def test_a_waiter_the_grown_service_time_would_make_late_is_shed_and_its_slot_passed_on() -> None:
    """Waiters are priced at the service time when they arrive; a burst makes it grow while they wait.
    When a slot comes, one whose time left is under the current p99 is shed (it would be served past the
    SLO) and the slot goes to the next waiter, who still has the time."""
    now = [0.0]
    tail = [0.010]
    limiter = ConcurrencyLimiter(limit=1, max_queue=10, name="m", slo_s=0.1, clock=lambda: now[0])
    assert limiter.try_acquire()
    early = asyncio.create_task(limiter.acquire(time_left_s=10.0, expected_s=0.01, tail_s=0.01,
                                                current_tail=lambda: tail[0]))
    while limiter.waiting < 1:
        await asyncio.sleep(0)
    now[0] = 0.060  # the early waiter has 40 ms of the SLO left ...
    late = asyncio.create_task(limiter.acquire(time_left_s=10.0, expected_s=0.01, tail_s=0.01,
                                               current_tail=lambda: tail[0]))
    while limiter.waiting < 2:
        await asyncio.sleep(0)
    tail[0] = 0.050  # ... and the service time's p99 grew to 50 ms meanwhile
    limiter.release()  # the early waiter has used over a quarter of its 90 ms budget: a standing queue, LIFO
    await late  # the newest waiter first: all of its 100 ms SLO left, served
    assert limiter.in_flight == 1
    limiter.release()
    with pytest.raises(Shed) as shed:
        await early
    assert shed.value.reason == "slo" and "grew to 50.0 ms" in str(shed.value)
    assert limiter.in_flight == 0 and limiter.waiting == 0  # its slot was freed (no waiter left to take it)
    tail[0] = 0.010
    assert limiter.try_acquire()
    kept = asyncio.create_task(limiter.acquire(time_left_s=10.0, expected_s=0.01, tail_s=0.01,
                                               current_tail=lambda: tail[0]))
    while limiter.waiting < 1:
        await asyncio.sleep(0)
    now[0] += 0.030
    limiter.release()
    await kept  # 70 ms left against a 10 ms p99: served
    assert limiter.in_flight == 1


async def test_limiter_does_not_leak_slots_when_waiters_are_cancelled() -> None:
    limiter = ConcurrencyLimiter(limit=1, max_queue=4, name="m")
    assert limiter.try_acquire()
    waiter = asyncio.create_task(limiter.acquire(time_left_s=5, expected_s=0))
    await asyncio.sleep(0.01)
    limiter.release()  # handed to the waiter ...
    waiter.cancel()    # ... which goes away before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert limiter.in_flight == 0 and limiter.waiting == 0
    limiter.resize(limit=3, max_queue=0)
    assert [limiter.try_acquire() for _ in range(4)] == [True, True, True, False]


async def test_the_limit_in_force_backs_off_while_requests_queue_behind_slow_answers_and_grows_back() -> None:
    """AIMD on the service time: answers slower than a quarter of the SLO cut the limit by 10% (once per
    such service time) only while requests wait for a slot; answers within it grow it by 1/limit back to
    the configured one. A control-plane resize keeps a cut."""
    now = [0.0]
    limiter = ConcurrencyLimiter(limit=8, max_queue=10, name="m", slo_s=1.0, clock=lambda: now[0])
    for _ in range(8):
        assert limiter.try_acquire()
    limiter.release(0.010)  # the fastest answer yet: the target stays at a quarter of the SLO
    assert limiter.try_acquire()
    for _ in range(3):
        limiter.release(0.5)  # slow, but nobody waits: nothing to move to the router's queue
        assert limiter.try_acquire()
    assert limiter.concurrency == 8
    waiter = asyncio.create_task(limiter.acquire(time_left_s=100.0, expected_s=0.001))
    while limiter.waiting < 1:
        await asyncio.sleep(0)
    limiter.release(0.5)  # slow while a request waits: cut to 7.2, and the freed slot is not handed on
    assert limiter.concurrency == 7 and limiter.in_flight == 7 and limiter.waiting == 1
    limiter.release(0.5)  # within 0.5 s of the cut: its effect is not seen yet, no second cut
    await waiter
    assert limiter.concurrency == 7 and limiter.in_flight == 7
    now[0] = 0.6
    limiter.resize(limit=16, max_queue=10, slo_s=1.0)  # a cut limit stays cut under a new maximum
    assert limiter.concurrency == 7 and not limiter.try_acquire()
    for _ in range(40):
        limiter.release(0.010)
        assert limiter.try_acquire()
    assert 10 <= limiter.concurrency < 16  # about sqrt(2 x 40) slots regained in 40 fast answers
    assert [limiter.try_acquire() for _ in range(limiter.concurrency - 7)] == [True] * (limiter.concurrency - 7)
    assert not limiter.try_acquire()


async def test_a_model_whose_execution_takes_most_of_the_slo_keeps_its_concurrency() -> None:
    """The target is at least twice the fastest recent answer: a model that needs 40% of its SLO to run at
    all is not cut to one request in flight for being slower than a quarter of it."""
    limiter = ConcurrencyLimiter(limit=4, max_queue=10, name="m", slo_s=1.0)
    for _ in range(4):
        assert limiter.try_acquire()
    waiter = asyncio.create_task(limiter.acquire(time_left_s=100.0, expected_s=0.001))
    while limiter.waiting < 1:
        await asyncio.sleep(0)
    limiter.release(0.4)
    await waiter
    for _ in range(20):
        limiter.release(0.45)
        assert limiter.try_acquire()
    assert limiter.concurrency == 4


# -- traffic split -------------------------------------------------------------------------------

def test_split_follows_the_weights() -> None:
    split = TrafficSplit({"1": 90, "2": 10}, rng=random.Random(7))
    counts = Counter(split.choose() for _ in range(20_000))
    assert counts["2"] / 20_000 == pytest.approx(0.10, abs=0.01)
    assert TrafficSplit({"1": 0, "2": 3}).only == "2"


def test_sticky_split_is_a_function_of_the_request_id() -> None:
    split = TrafficSplit({"1": 50, "2": 50}, sticky=True)
    other = TrafficSplit({"1": 50, "2": 50}, sticky=True)
    ids = [f"request-{i}" for i in range(4000)]
    assert [split.choose(i) for i in ids] == [other.choose(i) for i in ids]
    assert Counter(split.choose(i) for i in ids)["2"] / 4000 == pytest.approx(0.5, abs=0.03)


@pytest.mark.parametrize(("weights", "field"), [({}, "weights"), ({"1": -1}, "weights['1']"),
                                                 ({"1": 0}, "weights")])
def test_split_refuses_bad_weights(weights: dict[str, float], field: str) -> None:
    with pytest.raises(InvalidArgument) as error:
        TrafficSplit(weights)
    assert error.value.field == field
