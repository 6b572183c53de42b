"""A replica failure never becomes INTERNAL, requests wait for a replica to come back within their
deadlines, a version whose every replica is down says so and when it is expected back, and the
planner keeps N+1 replicas (issue 12, item 1). Unit level, on fakes and the transport-free core."""

from __future__ import annotations

import asyncio
import random

import pytest

from opml_common.errors import InvalidArgument, OpmlError, Unavailable
from opml_devstack.testing.bus import fresh_metrics, sample
from opml_inference_router.placement import CostAwareSloPolicy, ModelDemand, Planner
from opml_inference_router.placement.fleet_config import FleetConfig
from opml_inference_router.routing import ModelPolicy, Replica, ReplicaFailed, Router, wire
from opml_inference_router.routing.replicas import ReplicaSet
from opml_inference_router.testing.placement import CPU, GPU, book, config, demand, fleet
from opml_inference_router_contract.model_config import ModelConfig

REQUEST = wire.encode_field(wire.MODEL_NAME, "m")


class FakeReplica(Replica):
    """Answers at once, or fails as a worker that cannot be reached (``dead``)."""

    def __init__(self, name: str, *, dead: bool) -> None:
        self.name, self.dead, self.calls = name, dead, 0

    async def call(self, method: str, request: bytes, *, timeout_s: float) -> bytes:
        self.calls += 1
        await asyncio.sleep(0)
        if self.dead:
            raise ReplicaFailed("UNAVAILABLE", "cannot reach the worker: connection refused", retriable=True,
                                eject=True)
        return request

    async def close(self) -> None:
        pass


def test_ejection_backoff_is_capped_for_any_number_of_failures() -> None:
    clock = [0.0]
    replicas = ReplicaSet(eject_s=1.0, max_eject_s=30.0, clock=lambda: clock[0])
    state = replicas.add(FakeReplica("a", dead=True))
    state.failures = 10**6  # 2 ** (10**6 - 1) as a float overflows; the backoff must not
    replicas.failed(state, eject=True, error="cannot reach the worker")
    assert state.ejected_until == 30.0
    state.failures = 0
    replicas.failed(state, eject=True)
    assert state.ejected_until == 1.0


def test_a_replica_marked_down_is_never_picked_not_even_in_a_panic() -> None:
    replicas = ReplicaSet(clock=lambda: 0.0, rng=random.Random(0))
    replicas.add(FakeReplica("a", dead=True))
    assert replicas.mark_down("a", "worker cpu-000 restarting", back_at=2.0)
    assert replicas.pick() is None and replicas.ready_count() == 0
    assert replicas.why_down() == "worker cpu-000 restarting, back in ~2 s"
    event = replicas.changed()
    assert replicas.mark_up("a") and event.is_set() and replicas.pick() is not None


def make_router(replicas: dict[str, FakeReplica]) -> tuple[Router, object]:
    metrics, registry = fresh_metrics("inference-router")
    router = Router(connect=lambda address: replicas[address], metrics=metrics, rng=random.Random(3))
    router.set_model("m", ModelPolicy(hedge=False))
    for address in replicas:
        router.add_replica("m", "1", address)
    return router, registry


async def test_a_request_waits_for_the_restarted_replica_within_its_deadline() -> None:
    replicas = {"old": FakeReplica("old", dead=True), "new": FakeReplica("new", dead=False)}
    metrics, registry = fresh_metrics("inference-router")
    router = Router(connect=lambda address: replicas[address], metrics=metrics, rng=random.Random(3))
    router.set_model("m", ModelPolicy(hedge=False))
    router.add_replica("m", "1", "old")
    waiting = asyncio.create_task(router.infer("m", "", REQUEST, timeout_s=60))
    while not sample(registry, "opml_inference_router_replica_waits_total", model="m", version="1"):
        await asyncio.sleep(0)  # until the request found the only replica failed and waits
    assert router.replica_down("old", "worker cpu-000 restarting", 1.0) == 1
    router.add_replica("m", "1", "new")  # what the control plane does once the worker is back
    await router.remove_replica("m", "1", "old")
    routed = await waiting
    assert routed.replica == "new" and replicas["old"].calls == 1


async def test_every_replica_down_is_unavailable_saying_why_and_when_it_is_back() -> None:
    router, _ = make_router({"a": FakeReplica("a", dead=False)})
    router.replica_down("a", "worker cpu-000 restarting", 2.0)
    with pytest.raises(Unavailable) as error:
        await router.infer("m", "", REQUEST, timeout_s=0.01)  # no time to wait for it
    assert error.value.code == "UNAVAILABLE"
    assert error.value.message == ("every replica of model 'm' version '1' is down "
                                   "(worker cpu-000 restarting, back in ~2 s)")


async def test_a_replica_failing_forever_never_gives_internal() -> None:
    router, _ = make_router({"a": FakeReplica("a", dead=True)})
    for _ in range(50):  # each failure ejects again; the backoff never overflows
        with pytest.raises(OpmlError) as error:
            await router.infer("m", "", REQUEST, timeout_s=0.01)
        assert error.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    served = router.describe("m")["versions"]["1"][0]
    assert served["ejected"]


def _planner(workers: int, *, slots: int = CPU.slots, **fleet_settings) -> Planner:
    cpu = CPU.model_copy(update={"slots": slots})
    return Planner(fleet=fleet((cpu, workers), (GPU, 1), **fleet_settings), policy=CostAwareSloPolicy())


def test_a_cold_model_gets_two_replicas_on_distinct_workers_by_default() -> None:
    plan = _planner(3, min_replicas=2).plan([demand("cold", rate=20)], book("cold"))
    placed = next(iter(plan.placements.values()))
    assert len(set(placed.workers)) == 2 and placed.option.replicas == 2
    one = _planner(3, min_replicas=1).plan([demand("cold", rate=20)], book("cold"))
    assert next(iter(one.placements.values())).option.cost_per_hour * 2 == pytest.approx(placed.option.cost_per_hour)


def test_the_model_config_overrides_the_fleet_floor_and_a_single_worker_gets_one_replica() -> None:
    single = config("solo", rate=20).model_copy(update={"min_replicas": 1})
    plan = _planner(3, min_replicas=2).plan([ModelDemand(single, 1, 20)], book("solo"))
    assert len(next(iter(plan.placements.values())).workers) == 1
    plan = _planner(1, min_replicas=2).plan([demand("cold", rate=20)], book("cold"))
    assert len(next(iter(plan.placements.values())).workers) == 1  # one worker: N+1 cannot be on distinct ones


def test_n_plus_one_yields_to_slots_another_model_needs() -> None:
    # 2 workers x 4 slots: five models need one replica each; the 3 slots left give N+1 to three of them,
    # and no model goes unplaced for another's second replica.
    names = [f"m{i}" for i in range(5)]
    plan = _planner(2, slots=4, min_replicas=2).plan([demand(n, rate=20, kinds=("cpu",)) for n in names], book(*names))
    assert sorted(len(s.workers) for s in plan.placements.values()) == [1, 1, 2, 2, 2] and not plan.unplaced


def test_min_replicas_is_checked_in_model_and_fleet_configs() -> None:
    data = {**config("m", rate=1).model_dump(mode="json"), "min_replicas": 0}
    with pytest.raises(InvalidArgument) as error:
        ModelConfig.from_dict(data)
    assert error.value.field == "min_replicas"
    assert FleetConfig.from_dict({"pool_kinds": [CPU.model_dump(mode="json")],
                                  "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}]}).min_replicas == 2
    with pytest.raises(InvalidArgument) as error:
        FleetConfig.from_dict({"pool_kinds": [CPU.model_dump(mode="json")], "min_replicas": 0,
                               "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}]})
    assert error.value.field == "min_replicas"
