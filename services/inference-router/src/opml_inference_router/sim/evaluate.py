"""The placement simulator: the real planner over a synthetic workload, judged by simulation.

Each policy plans with :class:`~opml_inference_router.placement.planner.Planner`, exactly as the
service will, from the *measured* profiles. Each placed model is then checked by a discrete-event
simulation of one of its replicas (:mod:`.des`) running the *true* profile with per-batch jitter,
at the model's rate split evenly over its replicas (random routing: each replica sees a Poisson
stream). A model attains its SLO when the simulated p99 is within it; an unplaced model does not.

:func:`replacement_round` then changes the world under a plan (some rates surge or fall, some
models get slower than profiled), feeds the simulated measurements to the
:class:`~opml_inference_router.placement.planner.Replanner`, checks its moves step by step and
simulates the new plan.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

from opml_inference_router.placement.fleet_config import ModelVersion
from opml_inference_router.placement.latency import ServiceCurve
from opml_inference_router.placement.moves import AddReplica, RemoveReplica, check_moves
from opml_inference_router.placement.plan import KindUsage, Plan
from opml_inference_router.placement.planner import Observation, Planner, Replanner
from opml_inference_router.placement.policy import PlacementPolicy
from opml_inference_router.placement.profile import ProfileBook
from opml_inference_router.sim.des import simulate_replica
from opml_inference_router.sim.workload import Workload


@dataclass(frozen=True)
class ModelOutcome:
    """How one model version fared: where it was placed and what the simulation measured."""

    model: ModelVersion
    rate_rps: float
    slo_ms: float
    pool_kind: str | None  # None: not placed
    replicas: int
    predicted_p99_ms: float | None
    measured_p99_ms: float  # inf when not placed
    busy: float  # simulated busy fraction of each of its replicas

    @property
    def met(self) -> bool:
        return self.measured_p99_ms <= self.slo_ms


def attainment(outcomes: tuple[ModelOutcome, ...]) -> float:
    """Fraction of model versions whose simulated p99 is within their SLO."""
    return sum(outcome.met for outcome in outcomes) / len(outcomes)


@dataclass(frozen=True)
class Evaluation:
    """One policy's plan over one workload, and how it fared."""

    policy: str
    plan: Plan
    planning_s: float
    outcomes: tuple[ModelOutcome, ...]
    usage: Mapping[str, KindUsage]
    cost_per_hour: float
    active_cost_per_hour: float

    @property
    def slo_attainment(self) -> float:
        return attainment(self.outcomes)

    @property
    def traffic_attainment(self) -> float:
        """Fraction of the requests that belong to a model version within its SLO."""
        total = sum(outcome.rate_rps for outcome in self.outcomes)
        return sum(outcome.rate_rps for outcome in self.outcomes if outcome.met) / total if total else 1.0

    def busy(self, kind: str) -> float:
        """Mean simulated busy fraction of the replicas on ``kind`` (0 when it has none)."""
        weighted = [(outcome.busy, outcome.replicas) for outcome in self.outcomes if outcome.pool_kind == kind]
        replicas = sum(count for _, count in weighted)
        return sum(busy * count for busy, count in weighted) / replicas if replicas else 0.0


def simulate_plan(plan: Plan, workload: Workload, *, seed: int, requests: int = 3000,
                  jitter: float = 0.08) -> tuple[ModelOutcome, ...]:
    """Simulates one replica of every placed model of the workload (at its demand's rate) with its
    true profile. Each model's arrivals come from its own seeded stream, so one model's outcome
    does not depend on the others."""
    outcomes = []
    for demand in workload.demands:
        model, slo = demand.model, demand.config.slo.p99_ms
        placed = plan.placements.get(model)
        if placed is None:
            outcomes.append(ModelOutcome(model, demand.rate_rps, slo, None, 0, None, float("inf"), 0.0))
            continue
        option = placed.option
        truth = workload.truth.get(model, option.pool_kind)
        service = ServiceCurve(truth, workload.fleet.kinds[option.pool_kind])
        run = simulate_replica(
            service.ms, max_batch=option.max_batch, queue_delay_ms=option.queue_delay_ms,
            rate_rps=max(demand.rate_rps / option.replicas, 1e-6), requests=requests, warmup=requests // 10,
            rng=random.Random(f"{seed}/{model}"), jitter=jitter,
        )
        outcomes.append(ModelOutcome(model, demand.rate_rps, slo, option.pool_kind, option.replicas,
                                     option.predicted_p99_ms, run.p99_ms, run.busy))
    return tuple(outcomes)


def evaluate(name: str, policy: PlacementPolicy, workload: Workload, *, seed: int, requests: int = 3000) -> Evaluation:
    """Plans ``workload`` with ``policy`` (timed) and simulates the plan."""
    planner = Planner(fleet=workload.fleet, policy=policy)
    started = time.perf_counter()
    plan = planner.plan(workload.demands, workload.profiles)
    planning_s = time.perf_counter() - started
    return Evaluation(
        policy=name,
        plan=plan,
        planning_s=planning_s,
        outcomes=simulate_plan(plan, workload, seed=seed, requests=requests),
        usage=plan.usage(workload.fleet),
        cost_per_hour=plan.cost_per_hour,
        active_cost_per_hour=plan.active_worker_cost_per_hour(workload.fleet),
    )


@dataclass(frozen=True)
class Replacement:
    """One re-placement after the world drifted away from a plan."""

    drifted: int  # model versions whose rate or speed changed
    moved: int  # model versions whose replicas changed
    adds: int
    removes: int
    replanning_s: float
    attainment_before: float  # the old plan, simulated in the drifted world
    attainment_after: float  # the new plan, simulated in the drifted world
    cost_before: float
    cost_after: float


def drift(workload: Workload, *, seed: int, fraction: float = 0.1) -> Workload:
    """The workload after ``fraction`` of its models drifted, a third each way: rate x4, rate x0.25,
    or every true latency x2 (the measured profiles stay as they were)."""
    rng = random.Random(f"drift/{seed}")
    chosen = rng.sample(range(len(workload.demands)), round(fraction * len(workload.demands)))
    demands, truth = list(workload.demands), ProfileBook(workload.truth)
    for position, index in enumerate(chosen):
        demand = demands[index]
        if position % 3 == 0:
            demands[index] = replace(demand, rate_rps=demand.rate_rps * 4)
        elif position % 3 == 1:
            demands[index] = replace(demand, rate_rps=demand.rate_rps * 0.25)
        else:
            for kind in demand.config.pool_kinds:
                truth.add(workload.truth.get(demand.model, kind).scaled(2.0), replace=True)
    return Workload(workload.fleet, tuple(demands), workload.profiles, truth)


def replacement_round(workload: Workload, policy: PlacementPolicy, plan: Plan, *, seed: int,
                      fraction: float = 0.1, requests: int = 3000) -> Replacement:
    """Drifts the world under ``plan``, re-places from what the simulation measured, verifies every
    move keeps capacity (:func:`check_moves` raises otherwise) and simulates the new plan."""
    drifted = drift(workload, seed=seed, fraction=fraction)
    before = simulate_plan(plan, drifted, seed=seed, requests=requests)
    observations = {outcome.model: Observation(outcome.rate_rps, outcome.measured_p99_ms)
                    for outcome in before if outcome.pool_kind is not None}
    replanner = Replanner(planner=Planner(fleet=workload.fleet, policy=policy))
    started = time.perf_counter()
    result = replanner.replan(plan, workload.demands, workload.profiles, observations)
    replanning_s = time.perf_counter() - started
    check_moves(plan, result.plan, result.moves, workload.fleet)
    after = simulate_plan(result.plan, drifted, seed=seed, requests=requests)
    return Replacement(
        drifted=round(fraction * len(workload.demands)),
        moved=len({action.replica.model for action in result.moves if isinstance(action, AddReplica | RemoveReplica)}),
        adds=sum(isinstance(action, AddReplica) for action in result.moves),
        removes=sum(isinstance(action, RemoveReplica) for action in result.moves),
        replanning_s=replanning_s,
        attainment_before=attainment(before),
        attainment_after=attainment(after),
        cost_before=plan.cost_per_hour,
        cost_after=result.plan.cost_per_hour,
    )
