"""One suite for every PlacementPolicy: the contract of the ABC (placement/policy.py), run against
each implementation. What one policy prefers (cost, regret, best fit) stays in test_planner.py."""

from __future__ import annotations

from collections import Counter

import pytest

from opml_inference_router.placement import (
    CostAwareSloPolicy,
    GreedyFirstFitPolicy,
    PlacementPolicy,
    Planner,
    PoolKind,
    batch_caps,
)
from opml_inference_router.placement.fleet import WorkerRoom
from opml_inference_router.testing.placement import ACCEL, CPU, GPU, book, demand, fleet, profiles

POLICIES = {"cost-aware-slo": CostAwareSloPolicy, "greedy-first-fit": GreedyFirstFitPolicy}


@pytest.fixture(params=list(POLICIES), ids=list(POLICIES))
def policy(request: pytest.FixtureRequest) -> PlacementPolicy:
    return POLICIES[request.param]()


MIXED = fleet((CPU, 3), (GPU, 1), (ACCEL, 2))
DEMANDS = [demand("hot", rate=1500, kinds=("cpu", "gpu", "accel"), precisions=("fp32", "int8")),
           demand("warm", rate=200, kinds=("gpu", "cpu")),
           demand("cold", rate=5, kinds=("accel", "cpu"), precisions=("fp32", "int8"))]


def offered(policy: PlacementPolicy, the_demand, the_fleet=MIXED):
    kinds = the_demand.config.pool_kinds
    return policy.options(the_demand, {p.pool_kind: p for p in profiles(the_demand.model.name) if p.pool_kind in kinds},
                          the_fleet)


def test_options_are_sized_within_the_kinds_capacity_from_its_profile(policy: PlacementPolicy) -> None:
    for the_demand in DEMANDS:
        by_kind = {p.pool_kind: p for p in profiles(the_demand.model.name)}
        options = offered(policy, the_demand)
        assert options, f"{the_demand.model}: no option"
        for option in options:
            kind, profile = MIXED.kinds[option.pool_kind], by_kind[option.pool_kind]
            assert option.pool_kind in the_demand.config.pool_kinds
            assert 1 <= option.replicas <= len(MIXED.workers_of(kind.name)) * kind.slots
            assert (option.precision, option.memory_mib) == (profile.precision, profile.memory_mib)
            assert option.max_batch in batch_caps(kind, the_demand.config.batch_limit, profile)
            assert option.cost_per_hour == pytest.approx(option.replicas * kind.slot_cost_per_hour)


def test_a_rate_beyond_every_kinds_slots_gets_no_option(policy: PlacementPolicy) -> None:
    tiny = PoolKind(name="cpu", precisions=("fp32",), memory_mib=4096, slots=1, cost_per_hour=1.0,
                    execution_provider="CPUExecutionProvider")
    assert offered(policy, demand("flood", rate=1_000_000), fleet((tiny, 1))) == []


def test_order_names_every_model_version_once(policy: PlacementPolicy) -> None:
    options = {d.model: offered(policy, d) for d in DEMANDS}
    options[demand("none", rate=1).model] = []  # a model without options is still ordered
    ordered = policy.order(options)
    assert sorted(ordered) == sorted(options) and len(ordered) == len(options)


def test_rank_workers_returns_every_room_once(policy: PlacementPolicy) -> None:
    option = offered(policy, demand("wide", rate=200), fleet((CPU, 5)))[0]
    rooms = [WorkerRoom(worker, free_slots=1 + i % 3, free_memory_mib=1000.0 * (5 - i))
             for i, worker in enumerate(fleet((CPU, 5)).workers)]
    for current in (frozenset(), frozenset({"cpu-003"})):
        ranked = policy.rank_workers(option, rooms, current)
        assert Counter(id(room) for room in ranked) == Counter(id(room) for room in rooms)


def test_the_same_inputs_give_the_same_decisions(policy: PlacementPolicy) -> None:
    again = type(policy)()
    assert [offered(policy, d) for d in DEMANDS] == [offered(again, d) for d in DEMANDS]
    options = {d.model: offered(policy, d) for d in DEMANDS}
    assert policy.order(options) == again.order(dict(options))
    first = Planner(fleet=MIXED, policy=policy).plan(DEMANDS, book("hot", "warm", "cold"))
    second = Planner(fleet=MIXED, policy=again).plan(DEMANDS, book("hot", "warm", "cold"))
    assert first.placements == second.placements and first.unplaced == second.unplaced


def test_memory_and_slots_of_every_worker_are_respected(policy: PlacementPolicy) -> None:
    small = PoolKind(name="cpu", precisions=("fp32",), memory_mib=1000, slots=2, cost_per_hour=1.0,
                     execution_provider="CPUExecutionProvider")
    the_fleet = fleet((small, 3))
    big = [demand(f"big{i}", rate=1) for i in range(4)]  # 600 MiB each: one per worker
    plan = Planner(fleet=the_fleet, policy=policy).plan(big, book(*(d.model.name for d in big), memory=600))
    assert len(plan.placements) == 3 and len(plan.unplaced) == 1
    assert sorted(w for rs in plan.placements.values() for w in rs.workers) == ["cpu-000", "cpu-001", "cpu-002"]
    assert "no room for any option" in next(iter(plan.unplaced.values()))

    tiny = [demand(f"tiny{i}", rate=1) for i in range(7)]  # 100 MiB each: slots bind, 2 per worker
    plan = Planner(fleet=the_fleet, policy=policy).plan(tiny, book(*(d.model.name for d in tiny), memory=100))
    per_worker = Counter(w for rs in plan.placements.values() for w in rs.workers)
    assert len(plan.placements) == 6 and max(per_worker.values()) == 2
