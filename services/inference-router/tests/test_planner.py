"""The planner and its policies on small cases that can be checked by hand or by brute force."""

from __future__ import annotations

import itertools
import math
import random
import subprocess
import sys
from collections import Counter

import pytest

from opml_common.errors import InvalidArgument, OpmlError
from opml_inference_router.placement import (
    AddReplica,
    Batching,
    BatchQueueModel,
    CostAwareSloPolicy,
    Fleet,
    GreedyFirstFitPolicy,
    ModelDemand,
    ModelVersion,
    Observation,
    Plan,
    Planner,
    PoolKind,
    Profile,
    ProfileBook,
    RemoveReplica,
    Replanner,
    ServiceCurve,
    WaitReady,
    check_moves,
    replicas_of,
)
from opml_inference_router.sim import simulate_replica
from opml_inference_router.testing.placement import ACCEL, CPU, GPU, LADDER, book, config, demand, fleet, profiles


def slo_planner(the_fleet: Fleet) -> Planner:
    return Planner(fleet=the_fleet, policy=CostAwareSloPolicy())


# -- the cost-aware SLO policy -------------------------------------------------------------------


def test_a_cold_model_goes_to_the_cheapest_kind_that_meets_its_slo() -> None:
    the_fleet = fleet((CPU, 2), (GPU, 1))
    plan = slo_planner(the_fleet).plan([demand("cold", rate=20, kinds=("gpu", "cpu"))], book("cold"))
    placed = plan.placements[ModelVersion("cold", 1)]
    assert placed.option.pool_kind == "cpu" and placed.option.replicas == 1
    assert plan.cost_per_hour == pytest.approx(0.1)
    assert placed.option.predicted_p99_ms <= 0.9 * 40.0


def test_a_hot_model_goes_where_fewer_replicas_cost_less() -> None:
    # cpu: one replica takes ~200 rps within the SLO (0.1 each); accel: one replica takes thousands (0.25).
    the_fleet = fleet((CPU, 20), (ACCEL, 2))
    hot = demand("hot", rate=2000, kinds=("cpu", "accel"), precisions=("fp32", "int8"))
    policy = CostAwareSloPolicy()
    options = policy.options(hot, {p.pool_kind: p for p in profiles("hot") if p.pool_kind != "gpu"}, the_fleet)
    by_kind = {option.pool_kind: option for option in options}
    assert by_kind["cpu"].replicas >= 3 and by_kind["accel"].replicas == 1
    assert [option.pool_kind for option in options] == ["accel", "cpu"]  # cheapest first
    plan = Planner(fleet=the_fleet, policy=policy).plan([hot], book("hot"))
    assert plan.placements[hot.model].option.pool_kind == "accel"
    assert plan.cost_per_hour == pytest.approx(0.25)


def test_int8_accelerators_only_serve_models_that_allow_int8() -> None:
    the_fleet = fleet((CPU, 20), (ACCEL, 2))
    fp32_only = demand("exact", rate=2000, kinds=("cpu", "accel"))
    plan = slo_planner(the_fleet).plan([fp32_only], book("exact"))
    assert plan.placements[fp32_only.model].option.pool_kind == "cpu"
    accel_only = demand("stuck", rate=10, kinds=("accel",))
    plan = slo_planner(the_fleet).plan([accel_only], book("stuck"))
    assert accel_only.model not in plan.placements
    assert "runs int8, which the model does not allow (fp32)" in plan.unplaced[accel_only.model]


def test_claiming_by_regret_finds_the_cheapest_plan_a_first_come_order_misses() -> None:
    """One accelerator slot, two models that want it: the one that saves most gets it. Checked
    against every combination of the options the policy offers."""
    one_slot = PoolKind(name="accel", precisions=("int8",), memory_mib=16384, slots=1, cost_per_hour=0.25,
                        execution_provider="VitisAIExecutionProvider", batch_sizes=(1, 8, 32))
    the_fleet = fleet((CPU, 20), (GPU, 2), (one_slot, 1))
    light = demand("light", rate=50, kinds=("accel", "gpu"), precisions=("fp32", "int8"))  # saves 0.25 on accel
    heavy = demand("heavy", rate=1500, kinds=("accel", "cpu"), precisions=("fp32", "int8"))  # saves more
    demands, profile_book = [light, heavy], book("light", "heavy")
    policy = CostAwareSloPolicy()
    plan = Planner(fleet=the_fleet, policy=policy).plan(demands, profile_book)
    assert plan.placements[heavy.model].option.pool_kind == "accel"
    assert plan.placements[light.model].option.pool_kind == "gpu"

    offered = [policy.options(d, {p.pool_kind: p for p in profiles(d.model.name) if p.pool_kind in d.config.pool_kinds},
                              the_fleet) for d in demands]
    feasible = [combo for combo in itertools.product(*offered)
                if sum(o.replicas for o in combo if o.pool_kind == "accel") <= 1]
    cheapest = min(sum(o.cost_per_hour for o in combo) for combo in feasible)
    first_come = Planner(fleet=the_fleet, policy=GreedyOrderCostPolicy()).plan(demands, profile_book)
    assert plan.cost_per_hour == pytest.approx(cheapest)
    assert first_come.cost_per_hour > cheapest


class GreedyOrderCostPolicy(CostAwareSloPolicy):
    """The same options, claimed in the order given: what regret ordering is measured against."""

    def order(self, options):
        return list(options)


def test_replicas_spread_over_distinct_workers_while_there_are_enough() -> None:
    the_fleet = fleet((CPU, 4))
    plan = slo_planner(the_fleet).plan([demand("wide", rate=400)], book("wide"))
    workers = plan.placements[ModelVersion("wide", 1)].workers
    assert len(workers) == len(set(workers)) >= 3
    plan = slo_planner(the_fleet).plan([demand("wider", rate=1500)], book("wider"))
    workers = plan.placements[ModelVersion("wider", 1)].workers
    assert len(workers) > 4 and max(Counter(workers).values()) == math.ceil(len(workers) / 4)


def test_best_fit_packs_cold_models_onto_few_workers() -> None:
    the_fleet = fleet((CPU, 10))
    cold = [demand(f"cold{i}", rate=1) for i in range(20)]
    plan = slo_planner(the_fleet).plan(cold, book(*(d.model.name for d in cold)))
    assert len({w for rs in plan.placements.values() for w in rs.workers}) == 2  # 16 slots each
    assert plan.active_worker_cost_per_hour(the_fleet) == pytest.approx(3.2)
    assert plan.usage(the_fleet)["cpu"].used_slots == 20


def test_a_new_pool_kind_is_only_configuration() -> None:
    tpu = PoolKind(name="tpu", precisions=("bf16",), memory_mib=32768, slots=4, cost_per_hour=0.2,
                   execution_provider="TpuExecutionProvider")
    the_fleet = fleet((CPU, 2), (tpu, 1))
    model = demand("bf16-ok", rate=100, kinds=("cpu", "tpu"), precisions=("fp32", "bf16"))
    profile_book = ProfileBook([*profiles("bf16-ok")[:1],
                                Profile(model.model, "tpu", "bf16", {n: 0.5 + 0.05 * n for n in LADDER}, 800)])
    plan = slo_planner(the_fleet).plan([model], profile_book)
    assert plan.placements[model.model].option.pool_kind == "tpu"


def test_bad_demands_are_refused_with_the_field_named() -> None:
    the_fleet = fleet((CPU, 2))
    with pytest.raises(InvalidArgument) as caught:
        slo_planner(the_fleet).plan([demand("a", rate=1), demand("b", rate=1, kinds=("cpu", "fpga"))], book("a", "b"))
    assert caught.value.field == "demands[1].config.pool_kinds[1]"
    assert "but got 'fpga'" in caught.value.message
    with pytest.raises(InvalidArgument, match="demanded twice"):
        slo_planner(the_fleet).plan([demand("a", rate=1), demand("a", rate=2)], book("a"))
    with pytest.raises(InvalidArgument, match="slo_headroom"):
        CostAwareSloPolicy(slo_headroom=1.5)
    with pytest.raises(InvalidArgument, match="rate_rps"):
        ModelDemand(config("neg", rate=1), 1, -1.0)


def test_a_policy_that_breaks_its_contract_is_caught() -> None:
    class Forgetful(CostAwareSloPolicy):
        def order(self, options):
            return list(options)[:1]

    with pytest.raises(OpmlError, match="every model version to place exactly once"):
        Planner(fleet=fleet((CPU, 2)), policy=Forgetful()).plan([demand("a", rate=1), demand("b", rate=1)],
                                                                 book("a", "b"))


def test_unprofiled_or_impossible_models_are_reported_not_dropped_silently() -> None:
    the_fleet = fleet((CPU, 2), (GPU, 0))
    plan = slo_planner(the_fleet).plan([demand("ghost", rate=1, kinds=("gpu", "cpu")),
                                        demand("tight", rate=1, slo=1.0)], book("tight"))
    assert plan.unplaced[ModelVersion("ghost", 1)] == (
        "no pool kind can serve it (gpu: the fleet has no workers of this kind; cpu: not profiled)")
    assert "cpu: no replica set meets p99 <= 1.0 ms" in plan.unplaced[ModelVersion("tight", 1)]


# -- the greedy baseline -------------------------------------------------------------------------


def test_greedy_first_fit_is_worse_on_a_skewed_case() -> None:
    """A Zipf-like head model and a cold tail, each listing gpu first: greedy pays for gpus and
    sizes the head for throughput; the SLO policy meets every SLO for less."""
    the_fleet = fleet((CPU, 20), (GPU, 4))
    rates = [1200, 60, 30, 20, 15, 12]
    demands = [demand(f"z{i}", rate=rate, slo=10.0, kinds=("gpu", "cpu")) for i, rate in enumerate(rates)]
    profile_book = book(*(d.model.name for d in demands), cpu=(0.5, 1.5), gpu=(1.0, 0.5))
    slo_plan = slo_planner(the_fleet).plan(demands, profile_book)
    greedy_plan = Planner(fleet=the_fleet, policy=GreedyFirstFitPolicy()).plan(demands, profile_book)
    assert not slo_plan.unplaced and not greedy_plan.unplaced
    assert slo_plan.cost_per_hour < greedy_plan.cost_per_hour

    def simulated_p99(plan: Plan, d: ModelDemand) -> float:
        placed = plan.placements[d.model]
        option = placed.option
        service = ServiceCurve(profile_book.get(d.model, option.pool_kind), the_fleet.kinds[option.pool_kind])
        return simulate_replica(service.ms, max_batch=option.max_batch, queue_delay_ms=option.queue_delay_ms,
                                rate_rps=d.rate_rps / option.replicas, requests=5000, warmup=500,
                                rng=random.Random(3)).p99_ms

    assert all(simulated_p99(slo_plan, d) <= d.config.slo.p99_ms for d in demands)
    assert simulated_p99(greedy_plan, demands[0]) > demands[0].config.slo.p99_ms


# -- re-placement --------------------------------------------------------------------------------


def replay_capacity(before: Plan, after: Plan, moves) -> None:
    """An independent replay of the moves: ready capacity of every model never dips below the
    smaller of its capacity before and after, and new replicas are ready before any old one goes."""
    ready = Counter()
    for replica in replicas_of(before):
        ready[replica.model] += replica.capacity_rps
    floor = {m: min(before.placements[m].capacity_rps if m in before.placements else 0,
                    after.placements[m].capacity_rps if m in after.placements else 0)
             for m in set(before.placements) | set(after.placements)}
    for action in moves:
        if isinstance(action, WaitReady):
            for replica in action.replicas:
                ready[replica.model] += replica.capacity_rps
        elif isinstance(action, RemoveReplica):
            ready[action.replica.model] -= action.replica.capacity_rps
            assert ready[action.replica.model] >= floor[action.replica.model] - 1e-9


def test_a_surge_adds_replicas_before_anything_goes_and_leaves_the_rest_alone() -> None:
    the_fleet = fleet((CPU, 8), (ACCEL, 2))
    demands = [demand("surging", rate=150), demand("steady", rate=150), demand("idle", rate=5)]
    profile_book = book("surging", "steady", "idle")
    planner = slo_planner(the_fleet)
    plan = planner.plan(demands, profile_book)
    observed = {d.model: Observation(d.rate_rps, plan.placements[d.model].option.predicted_p99_ms) for d in demands}
    observed[ModelVersion("surging", 1)] = Observation(600, 30.0)
    result = Replanner(planner=planner).replan(plan, demands, profile_book, observed)
    assert set(result.reasons) == {ModelVersion("surging", 1)}
    assert "rate 600 rps is above the planned 150 rps" in result.reasons[ModelVersion("surging", 1)]
    grown = result.plan.placements[ModelVersion("surging", 1)]
    assert grown.capacity_rps >= 600 > plan.placements[ModelVersion("surging", 1)].capacity_rps
    for name in ("steady", "idle"):
        assert result.plan.placements[ModelVersion(name, 1)] == plan.placements[ModelVersion(name, 1)]
    assert {a.replica.model.name for a in result.moves if isinstance(a, AddReplica | RemoveReplica)} == {"surging"}
    check_moves(plan, result.plan, result.moves, the_fleet)
    replay_capacity(plan, result.plan, result.moves)


def test_a_move_to_another_kind_waits_for_the_new_replicas_before_removing_the_old() -> None:
    the_fleet = fleet((CPU, 8), (ACCEL, 2))
    model = demand("grows", rate=150, kinds=("cpu", "accel"), precisions=("fp32", "int8"))
    profile_book = book("grows")
    planner = slo_planner(the_fleet)
    plan = planner.plan([model], profile_book)
    assert plan.placements[model.model].option.pool_kind == "cpu"
    result = Replanner(planner=planner).replan(plan, [model], profile_book, {model.model: Observation(3000, 20.0)})
    assert result.plan.placements[model.model].option.pool_kind == "accel"
    kinds = [(type(a).__name__, a.replica.pool_kind if not isinstance(a, WaitReady) else None) for a in result.moves]
    first_remove = next(i for i, (name, _) in enumerate(kinds) if name == "RemoveReplica")
    assert ("WaitReady", None) in kinds[:first_remove] and ("AddReplica", "accel") in kinds[:first_remove]
    assert all(kind == "cpu" for name, kind in kinds if name == "RemoveReplica")
    check_moves(plan, result.plan, result.moves, the_fleet)
    replay_capacity(plan, result.plan, result.moves)


def test_a_harmless_latency_error_is_learnt_without_moving_anything() -> None:
    the_fleet = fleet((CPU, 8))
    model = demand("bit-slow", rate=20)
    profile_book = book("bit-slow")
    planner = slo_planner(the_fleet)
    plan = planner.plan([model], profile_book)
    predicted = plan.placements[model.model].option.predicted_p99_ms
    result = Replanner(planner=planner).replan(plan, [model], profile_book,
                                               {model.model: Observation(20, predicted * 1.4)})
    assert not result.reasons and not result.moves and result.plan == plan
    assert result.profiles.get(model.model, "cpu") != profile_book.get(model.model, "cpu")  # calibrated


def test_a_latency_drift_scales_the_profile_and_adds_capacity() -> None:
    the_fleet = fleet((CPU, 8))
    model = demand("slowed", rate=300)
    profile_book = book("slowed")
    planner = slo_planner(the_fleet)
    plan = planner.plan([model], profile_book)
    placed = plan.placements[model.model]
    truly = ServiceCurve(profile_book.get(model.model, "cpu").scaled(1.6), CPU)
    measured = BatchQueueModel().p99_ms(truly, Batching(placed.option.max_batch, placed.option.queue_delay_ms),
                                        300 / placed.option.replicas)
    result = Replanner(planner=planner).replan(plan, [model], profile_book, {model.model: Observation(300, measured)})
    assert "profile scaled by 1.60" in result.reasons[model.model]
    profiled = profile_book.get(model.model, "cpu").latency_ms(1)
    assert result.profiles.get(model.model, "cpu").latency_ms(1) == pytest.approx(1.6 * profiled)
    assert result.plan.placements[model.model].option.replicas > placed.option.replicas
    replay_capacity(plan, result.plan, result.moves)


def test_a_model_that_no_longer_fits_keeps_its_replicas_and_a_dropped_one_goes() -> None:
    the_fleet = fleet((CPU, 3))
    kept, dropped = demand("kept", rate=100), demand("dropped", rate=10)
    profile_book = book("kept", "dropped")
    planner = slo_planner(the_fleet)
    plan = planner.plan([kept, dropped], profile_book)
    result = Replanner(planner=planner).replan(plan, [kept], profile_book, {kept.model: Observation(100_000, 30.0)})
    assert "kept where it is" in result.reasons[kept.model]
    assert result.reasons[dropped.model] == "no longer demanded"
    assert result.plan.placements[kept.model] == plan.placements[kept.model]
    assert [type(a).__name__ for a in result.moves] == ["RemoveReplica"]
    check_moves(plan, result.plan, result.moves, the_fleet)


def test_the_core_imports_no_transport() -> None:
    """grpc, Kafka and onnxruntime plug in around the core later; the core must not need them."""
    code = ("import sys, opml_inference_router.placement, opml_inference_router.sim; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'grpc', 'aiokafka', 'onnxruntime', 'redis'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"
