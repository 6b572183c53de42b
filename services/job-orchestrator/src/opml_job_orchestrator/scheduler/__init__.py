"""Transport-free scheduler core: no grpc, no Kafka, no TensorFlow, no clock.

The orchestrator loop (behind the gRPC service) and the simulator both drive
:class:`~opml_job_orchestrator.scheduler.scheduler.Scheduler` the same way: report submits,
finishes and checkpoints, call ``schedule``, execute the decisions it returns.
"""

from opml_job_orchestrator.scheduler.capacity import Assignment, Cluster, NodeSpec
from opml_job_orchestrator.scheduler.model import (
    RESOURCE_DIMENSIONS,
    ROLE_NAMES,
    JobClass,
    JobSpec,
    Replica,
    Resources,
    RoleSpec,
)
from opml_job_orchestrator.scheduler.policies import (
    POLICY_PRESETS,
    BestFitPlacement,
    CheckpointPreemption,
    ClassPriorityQueue,
    FifoQueue,
    FirstFitPlacement,
    GpuSecondsPreemption,
    LowestResumeCostPreemption,
    NoPreemption,
    PlacementPolicy,
    PreemptionPolicy,
    QueuePolicy,
    SchedulingPolicy,
    fifo_policy,
    te_be_plus_policy,
    te_be_policy,
)
from opml_job_orchestrator.scheduler.scheduler import (
    Decision,
    JobRecord,
    JobState,
    PreemptJob,
    Scheduler,
    StartJob,
)

__all__ = [
    "POLICY_PRESETS",
    "RESOURCE_DIMENSIONS",
    "ROLE_NAMES",
    "Assignment",
    "BestFitPlacement",
    "CheckpointPreemption",
    "ClassPriorityQueue",
    "Cluster",
    "Decision",
    "FifoQueue",
    "FirstFitPlacement",
    "GpuSecondsPreemption",
    "JobClass",
    "JobRecord",
    "JobSpec",
    "JobState",
    "LowestResumeCostPreemption",
    "NoPreemption",
    "NodeSpec",
    "PlacementPolicy",
    "PreemptJob",
    "PreemptionPolicy",
    "QueuePolicy",
    "Replica",
    "Resources",
    "RoleSpec",
    "Scheduler",
    "SchedulingPolicy",
    "StartJob",
    "fifo_policy",
    "te_be_plus_policy",
    "te_be_policy",
]
