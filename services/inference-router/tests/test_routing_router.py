"""Unit tests of the Router with fake replicas: load-aware choice, backup requests and loser
cancellation, retries and ejection, deadlines, shedding, canary, control plane."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from opml_devstack.testing.bus import fresh_metrics, sample, wait_until
from opml_inference_router.routing import DeadlineExceeded, ModelPolicy, Replica, ReplicaFailed, Router, wire
from opml_inference_router.testing import mlp_config
from opml_inference_router_contract.model_config import ModelConfig

REQUEST = wire.encode_field(wire.MODEL_NAME, "m")


class FakeReplica(Replica):
    """A replica whose behaviour per call is ``behave(call_number) -> (delay_s, error or None)``."""

    def __init__(self, name: str, behave: Callable[[int], tuple[float, ReplicaFailed | None]]) -> None:
        self.name = name
        self.behave = behave
        self.calls = 0
        self.cancelled = 0
        self.completed = 0
        self.requests: list[bytes] = []
        self.closed = False

    async def call(self, method: str, request: bytes, *, timeout_s: float) -> bytes:
        self.calls += 1
        self.requests.append(request)
        delay, error = self.behave(self.calls)
        try:
            if delay > timeout_s:
                await asyncio.sleep(timeout_s)
                raise ReplicaFailed("DEADLINE_EXCEEDED", "deadline", retriable=False, eject=False)
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if error is not None:
            raise error
        self.completed += 1
        return wire.encode_field(wire.MODEL_NAME, "m") + self.name.encode().join([b"", b""])

    async def close(self) -> None:
        self.closed = True


def steady(delay: float) -> Callable[[int], tuple[float, None]]:
    return lambda _n: (delay, None)


def unavailable(_n: int) -> tuple[float, ReplicaFailed]:
    return 0.0, ReplicaFailed("UNAVAILABLE", "connection reset", retriable=True, eject=True)


def make_router(replicas: dict[str, FakeReplica], policy: ModelPolicy, *,
                version: str = "1") -> tuple[Router, CollectorRegistry]:
    metrics, registry = fresh_metrics("inference-router")
    router = Router(connect=lambda address: replicas[address], metrics=metrics, rng=random.Random(3))
    router.set_model("m", policy)
    for address in replicas:
        router.add_replica("m", version, address)
    return router, registry


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return sample(registry, f"opml_inference_router_{name}", **labels)


async def test_load_aware_choice_sends_less_to_a_slow_replica() -> None:
    # slow answers nothing until every request it was not given is answered (no clock involved: its
    # calls stay outstanding for as long as the test holds them)
    changed = asyncio.Event()
    slow, fast = HeldReplica("slow", changed), FakeReplica("fast", steady(0.0))
    router, registry = make_router({"slow": slow, "fast": fast}, ModelPolicy(hedge=False, max_concurrency=8))
    tasks = [asyncio.create_task(router.infer("m", "", REQUEST)) for _ in range(200)]
    for task in tasks:
        task.add_done_callback(lambda _task: changed.set())
    while sum(t.done() for t in tasks) < 200 - slow.calls:
        changed.clear()
        await changed.wait()
    slow.release.set()
    results = await asyncio.gather(*tasks)
    served = Counter(r.replica for r in results)
    assert served["fast"] > 4 * served["slow"] > 0
    assert metric(registry, "requests_total", model="m", version="1", code="OK") == 200


async def test_backup_request_wins_and_the_loser_is_cancelled() -> None:
    stalled = FakeReplica("stalled", steady(1.0))
    fast = FakeReplica("fast", steady(0.001))
    router, registry = make_router({"stalled": stalled, "fast": fast},
                                   ModelPolicy(slo_p99_ms=20, hedge_slo_fraction=0.25, default_timeout_ms=2000))
    router._rng.seed(0)
    routed = [await router.infer("m", "", REQUEST) for _ in range(6)]
    assert all(r.replica == "fast" for r in routed)
    hedged = [r for r in routed if r.backup_won]
    assert hedged and stalled.calls == len(hedged) and all(r.attempts == 2 for r in hedged)
    await asyncio.sleep(0)  # let the cancellations land
    assert stalled.cancelled == stalled.calls and stalled.completed == 0
    assert metric(registry, "backup_requests_total", model="m", version="1") == len(hedged)
    assert metric(registry, "backup_wins_total", model="m", version="1") == len(hedged)
    assert all(state.outstanding == 0 for state in router._models["m"].versions["1"].replicas)


async def test_backups_wait_for_the_observed_p95() -> None:
    a, b = FakeReplica("a", steady(0.005)), FakeReplica("b", steady(0.005))
    router, registry = make_router({"a": a, "b": b}, ModelPolicy(slo_p99_ms=4, hedge_slo_fraction=0.25,
                                                                 hedge_budget=1.0))
    for _ in range(8):  # too few samples: the backup goes after 0.25 x SLO = 1 ms, before the 5 ms answer
        await router.infer("m", "", REQUEST)
    assert metric(registry, "backup_requests_total", model="m", version="1") == 8
    for _ in range(100):  # then after the replica's p95 (~5 ms): only the slowest few get a backup
        await router.infer("m", "", REQUEST)
    assert metric(registry, "backup_requests_total", model="m", version="1") - 8 <= 30


class HeldReplica(FakeReplica):
    """A replica whose calls answer only once ``release`` is set (or end when cancelled: a loser);
    ``changed`` is set on every call."""

    def __init__(self, name: str, changed: asyncio.Event) -> None:
        super().__init__(name, steady(0.0))
        self.release = asyncio.Event()
        self.changed = changed

    async def call(self, method: str, request: bytes, *, timeout_s: float) -> bytes:
        self.calls += 1
        self.changed.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.completed += 1
        return wire.encode_field(wire.MODEL_NAME, "m") + self.name.encode().join([b"", b""])


async def test_backups_are_capped_by_the_budget() -> None:
    # stalled holds every call until the test releases it, so a backup (to fast) always wins its race;
    # all 100 requests are in flight at once (max_concurrency), so every one may get a backup
    changed = asyncio.Event()
    stalled, fast = HeldReplica("stalled", changed), FakeReplica("fast", steady(0.0))
    router, registry = make_router({"stalled": stalled, "fast": fast},
                                   ModelPolicy(slo_p99_ms=4, hedge_budget=0.05, selection="least",
                                               default_timeout_ms=60_000, max_concurrency=100))
    route = router._models["m"]
    for state in route.versions["1"].replicas:
        if state.name == "fast":
            state.outstanding = 1_000  # make "least" pick the stalled replica first every time
    tasks = [asyncio.create_task(router.infer("m", "", REQUEST)) for _ in range(100)]
    for task in tasks:
        task.add_done_callback(lambda _task: changed.set())

    def backups() -> float:
        return metric(registry, "backup_requests_total", model="m", version="1")

    # Settled: every request dispatched (its primary called), no token left for another backup, and
    # every request that got a backup answered by it while the stalled primaries still hold.
    while not (stalled.calls == 100 and route.hedge_tokens < 1 and sum(t.done() for t in tasks) == backups()):
        changed.clear()
        await changed.wait()
    stalled.release.set()
    results = await asyncio.gather(*tasks)
    assert 10 <= backups() <= 10 + 100 * 0.05 + 1  # the bucket starts full (10), then 0.05 per request
    assert sum(r.backup_won for r in results) == backups()


async def test_a_failed_replica_is_retried_elsewhere_and_ejected() -> None:
    dead, alive = FakeReplica("dead", unavailable), FakeReplica("alive", steady(0.001))
    router, registry = make_router({"dead": dead, "alive": alive}, ModelPolicy(hedge=False, eject_s=5))
    results = [await router.infer("m", "", REQUEST) for _ in range(20)]
    assert {r.replica for r in results} == {"alive"}
    assert dead.calls == 1  # ejected after its first failure
    assert metric(registry, "retries_total", model="m", version="1") == 1
    assert metric(registry, "replica_ejections_total", model="m", version="1", replica="dead") == 1
    assert {r["replica"]: r["ejected"] for r in router.describe("m")["versions"]["1"]} == {"dead": True, "alive": False}


async def test_errors_that_another_replica_cannot_fix_are_passed_on() -> None:
    bad_input = ReplicaFailed("INVALID_ARGUMENT", "inputs[0].shape: wrong", retriable=False, eject=False)
    a = FakeReplica("a", lambda _n: (0.0, bad_input))
    b = FakeReplica("b", lambda _n: (0.0, bad_input))
    router, registry = make_router({"a": a, "b": b}, ModelPolicy(hedge=False))
    with pytest.raises(ReplicaFailed) as error:
        await router.infer("m", "", REQUEST)
    assert error.value.code == "INVALID_ARGUMENT" and a.calls + b.calls == 1
    assert metric(registry, "requests_total", model="m", version="1", code="INVALID_ARGUMENT") == 1


async def test_every_replica_failing_ends_with_their_error_after_max_attempts() -> None:
    replicas = {name: FakeReplica(name, unavailable) for name in ("a", "b", "c", "d")}
    router, _ = make_router(replicas, ModelPolicy(hedge=False, max_attempts=3))
    with pytest.raises(ReplicaFailed) as error:
        await router.infer("m", "", REQUEST)
    assert error.value.code == "UNAVAILABLE"
    assert sum(r.calls for r in replicas.values()) == 3


async def test_deadline_bounds_the_request() -> None:
    a, b = FakeReplica("a", steady(1.0)), FakeReplica("b", steady(1.0))
    router, registry = make_router({"a": a, "b": b}, ModelPolicy(slo_p99_ms=10))
    with pytest.raises((DeadlineExceeded, ReplicaFailed)) as error:  # a bound on a hang only: 30 s
        await asyncio.wait_for(router.infer("m", "", REQUEST, timeout_s=0.05), 30)
    assert error.value.code == "DEADLINE_EXCEEDED"
    await asyncio.sleep(0)
    assert a.completed == b.completed == 0
    # the router itself ends it: replicas that never answer (nor time out on their own) are cancelled
    changed = asyncio.Event()
    held = {"a": HeldReplica("a", changed), "b": HeldReplica("b", changed)}
    router, _ = make_router(held, ModelPolicy(slo_p99_ms=10))
    with pytest.raises((DeadlineExceeded, ReplicaFailed)) as error:
        await asyncio.wait_for(router.infer("m", "", REQUEST, timeout_s=0.05), 30)
    assert error.value.code == "DEADLINE_EXCEEDED"
    await asyncio.sleep(0)
    calls = sum(r.calls for r in held.values())
    assert calls >= 1 and sum(r.cancelled for r in held.values()) == calls
    assert sum(r.completed for r in held.values()) == 0


async def test_a_request_without_a_deadline_gets_the_models_default_timeout_and_is_told_so() -> None:
    def policy(**setting: float) -> ModelPolicy:
        config = ModelConfig.from_dict({**mlp_config("m", p99_ms=10), **setting})
        return ModelPolicy.for_model(config, hedge=False)

    def slow() -> dict[str, FakeReplica]:  # answers in 0.5 s: past a 50 ms default, within a 60 s one
        return {"a": FakeReplica("a", steady(0.5))}

    router, registry = make_router(slow(), policy(default_timeout_ms=50))
    with pytest.raises(DeadlineExceeded) as error:  # a bound on a hang only: 30 s
        await asyncio.wait_for(router.infer("m", "", REQUEST), 30)
    assert error.value.code == "DEADLINE_EXCEEDED"
    assert error.value.message.startswith(
        "model 'm': no deadline from the caller: the model's default_timeout_ms (50 ms, from model.yaml) passed; "
        "set a deadline on the request or default_timeout_ms in model.yaml")
    assert metric(registry, "requests_total", model="m", version="1", code="DEADLINE_EXCEEDED") == 1

    router, _ = make_router(slow(), policy())  # unset: 4 x the SLO's 10 ms
    with pytest.raises(DeadlineExceeded) as error:
        await asyncio.wait_for(router.infer("m", "", REQUEST), 30)
    assert "the model's default_timeout_ms (40 ms, 4 x its p99 SLO of 10 ms) passed" in error.value.message

    router, _ = make_router(slow(), policy(default_timeout_ms=60_000))
    assert (await asyncio.wait_for(router.infer("m", "", REQUEST), 30)).replica == "a"

    router, _ = make_router(slow(), policy(default_timeout_ms=60_000))  # the caller's deadline: its own message
    with pytest.raises((DeadlineExceeded, ReplicaFailed)) as error:
        await asyncio.wait_for(router.infer("m", "", REQUEST, timeout_s=0.05), 30)
    assert error.value.code == "DEADLINE_EXCEEDED" and "caller" not in error.value.message


async def test_burst_over_capacity_is_shed_with_resource_exhausted() -> None:
    replica = FakeReplica("a", steady(0.05))
    router, registry = make_router({"a": replica}, ModelPolicy(slo_p99_ms=1000, hedge=False, max_concurrency=2,
                                                                   max_queue=3))
    results = await asyncio.gather(*(router.infer("m", "", REQUEST, timeout_s=5) for _ in range(20)),
                                   return_exceptions=True)
    shed = [r for r in results if isinstance(r, ResourceExhausted)]
    assert len(shed) == 15 and sum(1 for r in results if not isinstance(r, Exception)) == 5
    assert metric(registry, "shed_total", model="m", reason="queue_full") == 15
    assert metric(registry, "requests_total", model="m", version="1", code="RESOURCE_EXHAUSTED") == 15
    assert router._models["m"].limiter.in_flight == 0


async def test_requests_that_cannot_make_their_deadline_in_the_queue_are_shed() -> None:
    replica = FakeReplica("a", steady(0.03))
    router, registry = make_router({"a": replica}, ModelPolicy(hedge=False, max_concurrency=1, max_queue=100))
    for _ in range(10):  # learn the service time
        await router.infer("m", "", REQUEST)
    results = await asyncio.gather(*(router.infer("m", "", REQUEST, timeout_s=0.1) for _ in range(10)),
                                   return_exceptions=True)
    assert sum(1 for r in results if isinstance(r, ResourceExhausted)) >= 6
    assert metric(registry, "shed_total", model="m", reason="deadline") >= 6


def two_versions() -> tuple[Router, dict[str, FakeReplica], CollectorRegistry]:
    """Model ``m``: version 1 on replica v1 (the stable one), version 2 on v2 (no traffic yet)."""
    replicas = {"v1": FakeReplica("v1", steady(0)), "v2": FakeReplica("v2", steady(0))}
    metrics, registry = fresh_metrics("inference-router")
    router = Router(connect=lambda address: replicas[address], metrics=metrics, rng=random.Random(5))
    router.set_model("m", ModelPolicy(hedge=False))
    router.add_replica("m", "1", "v1")
    router.add_replica("m", "2", "v2")
    return router, replicas, registry


async def test_canary_split_promote_and_rollback() -> None:
    router, replicas, _ = two_versions()
    assert {(await router.infer("m", "", REQUEST)).version for _ in range(50)} == {"1"}  # new versions get nothing
    router.start_canary("m", "2", 25)
    counts = Counter([(await router.infer("m", "", REQUEST)).version for _ in range(2000)])
    assert counts["2"] / 2000 == pytest.approx(0.25, abs=0.03)
    assert wire.read_header(replicas["v2"].requests[-1]).model_version == "2"  # the chosen version is forwarded
    assert (await router.infer("m", "1", REQUEST)).replica == "v1"  # an explicit version bypasses the split
    assert router.rollback("m") == "1"
    assert {(await router.infer("m", "", REQUEST)).version for _ in range(50)} == {"1"}
    assert router.promote("m", "2") == "2"
    assert {(await router.infer("m", "", REQUEST)).version for _ in range(50)} == {"2"}
    assert router.rollback("m") == "2"  # promoted is the new stable
    with pytest.raises(FailedPrecondition):
        router.start_canary("m", "2", 10)
    with pytest.raises(NotFound):
        await router.infer("m", "9", REQUEST)
    with pytest.raises(NotFound):
        await router.infer("other", "", REQUEST)


async def test_a_retired_version_is_not_found_at_once_and_its_waiting_requests_are_told() -> None:
    """A canary rolled back and its replicas removed is no longer served: a request naming it gets
    NOT_FOUND at once, and one already waiting for its replica is answered NOT_FOUND then, not
    UNAVAILABLE when its deadline runs out (it held an admission slot all that time)."""
    router, _, registry = two_versions()
    router.start_canary("m", "2", 10)
    router.replica_down("v2", "its worker restarts")
    waiting = asyncio.create_task(router.infer("m", "2", REQUEST, timeout_s=600.0))
    await wait_until(lambda: metric(registry, "replica_waits_total", model="m", version="2") >= 1,
                     what="the request for version 2 waiting for a replica")
    assert router.rollback("m") == "1"
    await router.remove_replica("m", "2", "v2")
    with pytest.raises(NotFound) as error:
        await waiting
    assert "no longer served" in error.value.message
    with pytest.raises(NotFound):
        await router.infer("m", "2", REQUEST, timeout_s=600.0)
    assert router.describe("m")["versions"].keys() == {"1"}
    assert (await router.infer("m", "1", REQUEST)).replica == "v1"
    router.add_replica("m", "2", "v2")  # deployed again: served again
    assert (await router.infer("m", "2", REQUEST)).replica == "v2"
    await router.close()


async def test_a_request_the_split_sent_to_a_version_rolled_back_in_flight_is_answered_by_the_stable_one() -> None:
    """A rollback retires the canary while its requests are in flight: its worker closes their
    connection (a retriable failure) and it has no replica left. A request the traffic split routed
    there is routed again by the split, not failed (or left waiting out its deadline): a rollout's
    rollback fails none of the requests; one that named the version gets NOT_FOUND at once."""
    router, replicas, _ = two_versions()
    cut = asyncio.Event()

    async def cut_call(method: str, request: bytes, *, timeout_s: float) -> bytes:
        replicas["v2"].calls += 1
        await cut.wait()
        raise ReplicaFailed("UNAVAILABLE", "the worker closed the connection (stopped or killed)", retriable=True,
                            eject=True)

    replicas["v2"].call = cut_call
    router.start_canary("m", "2", 100)
    by_split = asyncio.create_task(router.infer("m", "", REQUEST, timeout_s=600.0))
    named = asyncio.create_task(router.infer("m", "2", REQUEST, timeout_s=600.0))
    await wait_until(lambda: replicas["v2"].calls == 2, what="both requests on version 2")
    assert router.rollback("m") == "1"
    await router.remove_replica("m", "2", "v2")
    cut.set()
    answered = await by_split
    assert (answered.version, answered.replica) == ("1", "v1")
    assert replicas["v1"].requests[-1].endswith(wire.encode_field(wire.MODEL_VERSION, "1"))
    with pytest.raises(NotFound, match="no longer served"):
        await named
    await router.close()


async def test_control_plane_adds_and_removes_replicas_and_shares_connections() -> None:
    made: list[str] = []
    fakes: dict[str, FakeReplica] = {}

    def connect(address: str) -> FakeReplica:
        made.append(address)
        fakes[address] = FakeReplica(address, steady(0))
        return fakes[address]

    metrics, registry = fresh_metrics("inference-router")
    router = Router(connect=connect, metrics=metrics)
    router.set_model("a", ModelPolicy())
    router.set_model("b", ModelPolicy())
    router.add_replica("a", "1", "w1:1")
    router.add_replica("b", "1", "w1:1")  # one worker, two models: one connection
    router.add_replica("a", "1", "w2:1")
    router.add_replica("a", "1", "w2:1")  # idempotent
    assert made == ["w1:1", "w2:1"] and router.is_ready("a") and router.is_ready("b", "1")
    assert metric(registry, "replica_outstanding_requests", model="a", version="1", replica="w1:1") == 0
    await router.remove_replica("a", "1", "w1:1")
    assert not fakes["w1:1"].closed  # model b still uses it
    assert {(await router.infer("a", "", REQUEST)).replica for _ in range(10)} == {"w2:1"}
    await router.remove_model("b")
    assert fakes["w1:1"].closed and not router.is_ready("b")
    with pytest.raises(NotFound):
        await router.remove_replica("a", "1", "w1:1")
    await router.remove_replica("a", "1", "w2:1")
    assert not router.is_ready("a")
    with pytest.raises(Exception) as error:
        await router.infer("a", "", REQUEST)
    assert error.value.code == "UNAVAILABLE"
    await router.close()


async def test_a_model_without_versions_is_unavailable_and_policies_derive_from_the_config() -> None:
    metrics, _ = fresh_metrics("inference-router")
    router = Router(connect=lambda address: FakeReplica(address, steady(0)), metrics=metrics)
    router.set_model("m", ModelPolicy())
    with pytest.raises(Exception) as error:
        await router.infer("m", "", REQUEST)
    assert error.value.code == "UNAVAILABLE" and not router.is_ready("m")
    policy = ModelPolicy.for_model(ModelConfig.from_dict(mlp_config("m", p99_ms=30, max_batch_size=16)), replicas=2,
                                   hedge=False)
    assert (policy.slo_p99_ms, policy.max_concurrency, policy.max_queue, policy.hedge) == (30.0, 64, 256, False)
    assert policy.default_timeout_s == pytest.approx(0.12)
    configured = ModelConfig.from_dict({**mlp_config("m", p99_ms=30), "default_timeout_ms": 5000})
    assert ModelPolicy.for_model(configured).default_timeout_s == pytest.approx(5.0)
    with pytest.raises(InvalidArgument) as error:
        ModelPolicy(max_concurrency=0)
    assert error.value.field == "max_concurrency"


async def test_a_saturated_model_does_not_slow_down_another() -> None:
    changed = asyncio.Event()
    hot = HeldReplica("hot", changed)  # its first batch runs until the test lets it end
    replicas = {"hot": hot, "calm": FakeReplica("calm", steady(0.001))}
    metrics, _ = fresh_metrics("inference-router")
    router = Router(connect=lambda address: replicas[address], metrics=metrics)
    router.set_model("hot", ModelPolicy(hedge=False, max_concurrency=2, max_queue=2))
    router.set_model("calm", ModelPolicy(hedge=False, max_concurrency=2, max_queue=2))
    router.add_replica("hot", "1", "hot")
    router.add_replica("calm", "1", "calm")
    burst = [asyncio.create_task(router.infer("hot", "", REQUEST, timeout_s=60)) for _ in range(50)]
    for task in burst:
        task.add_done_callback(lambda _task: changed.set())
    while not (hot.calls == 2 and sum(t.done() for t in burst) == 46):  # saturated: 2 running, 2 queued, 46 shed
        changed.clear()
        await changed.wait()
    for _ in range(10):
        assert (await router.infer("calm", "", REQUEST)).replica == "calm"
    assert hot.completed == 0 and hot.calls == 2  # ten calm requests finished while the hot model's first batch runs
    hot.release.set()
    results = await asyncio.gather(*burst, return_exceptions=True)
    assert sum(isinstance(r, ResourceExhausted) for r in results) == 46
