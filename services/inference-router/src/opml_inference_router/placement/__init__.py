"""Transport-free placement core (the DLIS "model master"): no grpc, Kafka or onnxruntime here.

The deploy API reads a bundle's ``ModelConfig`` (the router's contract, since model producers write
it: :mod:`opml_inference_router_contract.model_config`) and places it on the pools of a
:class:`FleetConfig`; the profiler stores a :class:`Profile` per allowed pool kind, the
:class:`Planner` turns demands into a :class:`Plan` with a :class:`PlacementPolicy`, and the
:class:`Replanner` turns serving measurements into a new plan and the capacity-safe actions
(:func:`plan_moves`) an executor carries out on the workers.
"""

from opml_inference_router.placement.fleet import Fleet, Occupancy, Worker, WorkerRoom
from opml_inference_router.placement.fleet_config import (
    FleetConfig,
    ModelVersion,
    PoolConfig,
    PoolKind,
    load_fleet_config,
)
from opml_inference_router.placement.latency import (
    Batching,
    BatchQueueModel,
    LatencyModel,
    ServiceCurve,
    batch_caps,
    calibration_factor,
)
from opml_inference_router.placement.moves import (
    Action,
    AddReplica,
    RemoveReplica,
    Replica,
    ResizeReplica,
    WaitReady,
    check_moves,
    plan_moves,
    replicas_of,
)
from opml_inference_router.placement.plan import (
    KindUsage,
    ModelDemand,
    Option,
    Plan,
    ReplicaSet,
    SessionChoice,
    demands_for,
)
from opml_inference_router.placement.planner import Observation, Planner, Replan, Replanner
from opml_inference_router.placement.policy import CostAwareSloPolicy, GreedyFirstFitPolicy, PlacementPolicy
from opml_inference_router.placement.predicted import ProfilePredictor
from opml_inference_router.placement.profile import Profile, ProfileBook
from opml_inference_router.placement.serving import ServingConfigChooser, ServingTable
from opml_inference_router.placement.sites import LOCAL_LINK, Link, SiteRule, WorkerCheck, site_distance

__all__ = [
    "Action",
    "AddReplica",
    "BatchQueueModel",
    "Batching",
    "CostAwareSloPolicy",
    "Fleet",
    "FleetConfig",
    "GreedyFirstFitPolicy",
    "KindUsage",
    "LOCAL_LINK",
    "LatencyModel",
    "Link",
    "ModelDemand",
    "ModelVersion",
    "Observation",
    "Occupancy",
    "Option",
    "PlacementPolicy",
    "Plan",
    "Planner",
    "PoolConfig",
    "PoolKind",
    "Profile",
    "ProfilePredictor",
    "ProfileBook",
    "RemoveReplica",
    "ResizeReplica",
    "Replan",
    "Replanner",
    "Replica",
    "ReplicaSet",
    "ServiceCurve",
    "ServingConfigChooser",
    "ServingTable",
    "SessionChoice",
    "SiteRule",
    "WaitReady",
    "Worker",
    "WorkerCheck",
    "WorkerRoom",
    "batch_caps",
    "calibration_factor",
    "check_moves",
    "demands_for",
    "site_distance",
    "load_fleet_config",
    "plan_moves",
    "replicas_of",
]
