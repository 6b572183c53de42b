"""Placement simulator: the real planner over a synthetic fleet (default 1,000 models on 200
workers of three kinds, Zipf rates), judged by a discrete-event simulation of every placed model
against its true (not its profiled) performance, next to the greedy first-fit baseline."""

from opml_inference_router.sim.des import ReplicaRun, simulate_replica
from opml_inference_router.sim.evaluate import (
    Evaluation,
    ModelOutcome,
    Replacement,
    attainment,
    drift,
    evaluate,
    replacement_round,
    simulate_plan,
)
from opml_inference_router.sim.workload import POOL_KINDS, Workload, synthetic_fleet, synthetic_workload

__all__ = [
    "POOL_KINDS",
    "Evaluation",
    "ModelOutcome",
    "Replacement",
    "ReplicaRun",
    "Workload",
    "attainment",
    "drift",
    "evaluate",
    "replacement_round",
    "simulate_plan",
    "simulate_replica",
    "synthetic_fleet",
    "synthetic_workload",
]
