"""The control plane's state as ``opml.inference.v1`` messages (the API's replies and the events' data)."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from opml.inference.v1 import deployments_pb2 as pb

from opml_inference_router.control.state import DEPLOYING, FAILED, SERVING, ModelRecord, Source
from opml_inference_router.placement import ModelVersion, replicas_of

if TYPE_CHECKING:
    from opml_inference_router.control.deployments import DeploymentManager

_STATES = {DEPLOYING: pb.DEPLOYING, SERVING: pb.SERVING, FAILED: pb.FAILED}


def set_source(message, source: Source) -> None:
    """Fills the ``bundle``/``model_dir`` oneof of a message that has one."""
    if source.bundle:
        message.bundle.CopyFrom(pb.BundleRef(context=source.context, bundle=source.bundle))
    elif source.model_dir:
        message.model_dir = source.model_dir


def deployment(manager: DeploymentManager, record: ModelRecord) -> pb.Deployment:
    traffic = manager.traffic_percent(record.name)
    replicas = {replica_set.model: replica_set for replica_set in manager.plan.placements.values()}
    message = pb.Deployment(name=f"models/{record.name}", model=record.name, stable_version=record.stable or 0)
    newest = max((e for e in record.versions.values() if e.config is not None), key=lambda e: e.version, default=None)
    if newest is not None and newest.config is not None:
        message.slo_p99_ms = newest.config.slo.p99_ms
        message.expected_rate_rps = newest.config.expected_rate_rps
    for number, entry in sorted(record.versions.items()):
        model = ModelVersion(record.name, number)
        status = message.versions.add(name=f"models/{record.name}/versions/{number}", version=number,
                                      state=_STATES[entry.state], reason=entry.reason,
                                      traffic_percent=traffic.get(str(number), 0.0), bundle_uuid=entry.bundle_uuid)
        set_source(status, entry.source)
        status.create_time.FromNanoseconds(int(entry.created * 1e9))
        placed = replicas.get(model)
        if placed is not None:
            status.predicted_p99_ms = placed.option.predicted_p99_ms
            status.planned_rate_rps = placed.rate_rps
            for worker_id in sorted(set(placed.workers)):
                pool_worker = manager.pools.get(worker_id)
                status.replicas.add(worker=worker_id, pool_kind=placed.option.pool_kind, address=pool_worker.address,
                                    precision=placed.option.precision, max_batch=placed.option.max_batch,
                                    memory_mib=placed.option.memory_mib,
                                    capacity_rps=placed.option.replica_capacity_rps)
        for profile in manager.profiles:
            if profile.model == model:
                status.profiles.add(pool_kind=profile.pool_kind, precision=profile.precision,
                                    batch_latency_ms=dict(profile.batch_latency_ms), memory_mib=profile.memory_mib)
    return message


def placement(manager: DeploymentManager) -> pb.Placement:
    plan, fleet = manager.plan, manager.fleet
    hosted = defaultdict(list)
    for replica in replicas_of(plan):
        hosted[replica.worker].append(replica)
    message = pb.Placement(cost_per_hour=plan.cost_per_hour,
                           active_worker_cost_per_hour=plan.active_worker_cost_per_hour(fleet),
                           unavailable_pool_kinds=manager.pools.unavailable_kinds)
    for pool_worker in manager.pools.workers():
        worker = pool_worker.worker
        replicas = hosted.get(worker.id, [])
        entry = message.workers.add(worker=worker.id, pool=worker.pool, pool_kind=worker.kind.name,
                                    address=pool_worker.address, alive=pool_worker.alive,
                                    restarts=pool_worker.restarts, slots=worker.kind.slots, used_slots=len(replicas),
                                    memory_mib=worker.kind.memory_mib,
                                    used_memory_mib=sum(r.memory_mib for r in replicas))
        for replica in replicas:
            entry.replicas.add(model=replica.model.name, version=replica.model.version, precision=replica.precision,
                               max_batch=replica.max_batch, memory_mib=replica.memory_mib,
                               capacity_rps=replica.capacity_rps)
    for model, reason in sorted(plan.unplaced.items()):
        message.unplaced.add(model=model.name, version=model.version, reason=reason)
    return message
