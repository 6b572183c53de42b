"""The placement simulator at a small scale: deterministic per seed, and the planner ahead of greedy."""

from __future__ import annotations

import random

import pytest

from opml_inference_router.placement import CostAwareSloPolicy, GreedyFirstFitPolicy
from opml_inference_router.sim import (
    evaluate,
    replacement_round,
    simulate_replica,
    synthetic_workload,
)

SMALL = {"models": 120, "workers": 24, "total_rate_rps": 12_000.0}


def test_a_lone_replica_serves_each_request_in_its_service_time() -> None:
    run = simulate_replica(lambda n: 2.0 * n, max_batch=1, queue_delay_ms=0.0, rate_rps=1.0, requests=500,
                           rng=random.Random(1))
    assert run.p99_ms == pytest.approx(2.0, abs=0.01) and run.busy < 0.01 and run.requests == 500


def test_a_replica_near_capacity_queues() -> None:
    calm = simulate_replica(lambda n: 1.0 + 0.5 * n, max_batch=8, queue_delay_ms=1.0, rate_rps=500, requests=4000,
                            rng=random.Random(2))
    busy = simulate_replica(lambda n: 1.0 + 0.5 * n, max_batch=8, queue_delay_ms=1.0, rate_rps=1500, requests=4000,
                            rng=random.Random(2))
    assert busy.p99_ms > calm.p99_ms and busy.busy > calm.busy


def test_the_workload_and_its_evaluation_are_deterministic_per_seed() -> None:
    first, again, other = (synthetic_workload(seed=seed, **SMALL) for seed in (11, 11, 12))
    assert first.demands == again.demands and first.demands != other.demands
    assert [p.to_dict() for p in first.profiles] == [p.to_dict() for p in again.profiles]
    one = evaluate("planner", CostAwareSloPolicy(), first, seed=11, requests=600)
    two = evaluate("planner", CostAwareSloPolicy(), again, seed=11, requests=600)
    assert one.outcomes == two.outcomes and one.plan == two.plan


def test_measured_profiles_differ_from_the_truth_the_check_runs() -> None:
    workload = synthetic_workload(seed=3, **SMALL)
    demand = workload.demands[0]
    kind = demand.config.pool_kinds[0]
    assert workload.profiles.get(demand.model, kind) != workload.truth.get(demand.model, kind)


def test_the_planner_beats_greedy_first_fit_on_a_skewed_fleet() -> None:
    workload = synthetic_workload(seed=5, **SMALL)
    planner = evaluate("planner", CostAwareSloPolicy(), workload, seed=5, requests=1000)
    greedy = evaluate("greedy", GreedyFirstFitPolicy(), workload, seed=5, requests=1000)
    assert planner.slo_attainment >= 0.97
    assert planner.slo_attainment > greedy.slo_attainment
    assert planner.traffic_attainment > greedy.traffic_attainment
    assert planner.cost_per_hour < greedy.cost_per_hour
    for usage in planner.usage.values():
        assert usage.used_slots <= usage.slots and usage.used_memory_mib <= usage.memory_mib


def test_a_replacement_round_keeps_capacity_and_recovers_slo() -> None:
    workload = synthetic_workload(seed=7, **SMALL)
    policy = CostAwareSloPolicy()
    placed = evaluate("planner", policy, workload, seed=7, requests=1000)
    result = replacement_round(workload, policy, placed.plan, seed=7, fraction=0.2, requests=1000)  # check_moves inside
    assert result.moved > 0 and result.adds > 0
    assert result.attainment_after > result.attainment_before
