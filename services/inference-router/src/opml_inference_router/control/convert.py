"""The control plane's state and changes as ``opml.inference.v1`` messages: the API's replies
(:func:`deployment`, :func:`placement`, the serving-configuration replies) and the deployment events the manager emits (``*_event``).

It reads the domain types only (:class:`~.view.DeploymentView`, the records, the plan): the
manager imports it to build its events, never the other way round."""

from __future__ import annotations

from collections import defaultdict

from opml.inference.v1 import deployment_events_pb2 as events
from opml.inference.v1 import deployments_pb2 as pb

from opml_common.errors import InvalidArgument, OpmlError
from opml_common.perfmodel import Sample, ServingConfig
from opml_common.perfmodel.space import EXECUTION_MODES, OPT_LEVELS, PRECISIONS
from opml_inference_router.control.serving_models import Fit
from opml_inference_router.control.state import DEPLOYING, FAILED, SERVING, ModelRecord, Source
from opml_inference_router.control.view import DeploymentView
from opml_inference_router.placement import (
    AddReplica,
    ModelVersion,
    RemoveReplica,
    Replan,
    SessionChoice,
    replicas_of,
)
from opml_inference_router_contract.client import serving_config

_STATES = {DEPLOYING: pb.DEPLOYING, SERVING: pb.SERVING, FAILED: pb.FAILED}


def set_source(message, source: Source) -> None:
    """Fills the ``bundle``/``model_dir`` oneof of a message that has one."""
    if source.bundle:
        message.bundle.CopyFrom(pb.BundleRef(context=source.context, bundle=source.bundle))
    elif source.model_dir:
        message.model_dir = source.model_dir


def _placement_note(view: DeploymentView, model: ModelVersion) -> str:
    """Why a serving version runs fewer replicas than before a worker was lost, or none ('' if neither)."""
    placed = view.plan.placements.get(model)
    if placed is not None:
        return f"short of replicas: {placed.short}" if placed.short else ""
    unplaced = view.plan.unplaced.get(model)
    return f"no replica: {unplaced}" if unplaced else ""


def session_options(session: SessionChoice) -> pb.SessionOptions:
    return pb.SessionOptions(threads=session.threads, opt_level=session.opt_level,
                             execution_mode=session.execution_mode, basis=session.basis)


def deployment(view: DeploymentView, record: ModelRecord) -> pb.Deployment:
    traffic = view.traffic_percent(record.name)
    replicas = {replica_set.model: replica_set for replica_set in view.plan.placements.values()}
    message = pb.Deployment(name=f"models/{record.name}", model=record.name, stable_version=record.stable or 0)
    newest = max((e for e in record.versions.values() if e.config is not None), key=lambda e: e.version, default=None)
    if newest is not None and newest.config is not None:
        message.slo_p99_ms = newest.config.slo.p99_ms
        message.expected_rate_rps = newest.config.expected_rate_rps
    for number, entry in sorted(record.versions.items()):
        model = ModelVersion(record.name, number)
        status = message.versions.add(name=f"models/{record.name}/versions/{number}", version=number,
                                      state=_STATES[entry.state], reason=entry.reason or _placement_note(view, model),
                                      traffic_percent=traffic.get(str(number), 0.0), bundle_uuid=entry.bundle_uuid)
        set_source(status, entry.source)
        status.create_time.FromNanoseconds(int(entry.created * 1e9))
        placed = replicas.get(model)
        if placed is not None:
            status.predicted_p99_ms = max(part.option.predicted_p99_ms for part in placed.parts())
            status.planned_rate_rps = sum(part.rate_rps for part in placed.parts())  # each group plans its share
            for part in placed.parts():  # its instance groups' replicas too, each with its kind and precision
                option = part.option
                for worker_id in sorted(set(part.workers)):
                    pool_worker = view.pools.get(worker_id)
                    status.replicas.add(worker=worker_id, pool_kind=option.pool_kind, address=pool_worker.address,
                                        precision=option.precision, max_batch=option.max_batch,
                                        memory_mib=option.memory_mib, capacity_rps=option.replica_capacity_rps,
                                        session=session_options(option.session))
        for profile in view.profiles:
            if profile.model == model:
                status.profiles.add(pool_kind=profile.pool_kind, precision=profile.precision,
                                    batch_latency_ms=dict(profile.batch_latency_ms), memory_mib=profile.memory_mib)
    return message


def placement(view: DeploymentView) -> pb.Placement:
    plan, fleet = view.plan, view.fleet
    hosted = defaultdict(list)
    for replica in replicas_of(plan):
        hosted[replica.worker].append(replica)
    message = pb.Placement(cost_per_hour=plan.cost_per_hour,
                           active_worker_cost_per_hour=plan.active_worker_cost_per_hour(fleet),
                           unavailable_pool_kinds=view.pools.unavailable_kinds)
    for pool_worker in view.pools.workers():
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
                               capacity_rps=replica.capacity_rps, session=session_options(replica.session))
    for model, reason in sorted(plan.unplaced.items()):
        message.unplaced.add(model=model.name, version=model.version, reason=reason)
    return message


# -- events (opml.inference.v1.deployment_events) ---------------------------------------------------


def deployed_event(view: DeploymentView, record: ModelRecord, version: int) -> events.ModelDeployed:
    return events.ModelDeployed(deployment=deployment(view, record), version=version)


def undeployed_event(name: str) -> events.ModelUndeployed:
    return events.ModelUndeployed(model=name)


def traffic_event(view: DeploymentView, record: ModelRecord, cause: str) -> events.TrafficChanged:
    return events.TrafficChanged(model=record.name, traffic_percent=view.traffic_percent(record.name),
                                 stable_version=record.stable or 0, cause=cause)


def placement_event(view: DeploymentView, reasons: list[str], replan: Replan | None = None) -> events.PlacementChanged:
    """The placement after a change; with ``replan``, the replicas its moves added and removed."""
    message = events.PlacementChanged(placement=placement(view), reasons=reasons)
    if replan is not None:
        message.replicas_added = sum(isinstance(a, AddReplica) for a in replan.moves)
        message.replicas_removed = sum(isinstance(a, RemoveReplica) for a in replan.moves)
    return message


def failed_event(name: str | None, version: int, source: Source, error: OpmlError) -> events.DeployFailed:
    message = events.DeployFailed(model=name or "", version=version, code=error.code, reason=error.message)
    set_source(message, source)
    return message


# -- serving configurations (MeasureServingConfigs, PredictServingPerformance) ---------------------

def serving_configs(messages, *, most: int, field: str = "configs") -> list[ServingConfig]:
    """The request's configurations, every field that breaks the space reported at once (with its
    index); proto3's empty values take ServingConfig's defaults (threads 1, all, sequential, fp32).

    Raises: InvalidArgument: none given, more than ``most``, or a value outside the space.
    """
    if not 1 <= len(messages) <= most:
        raise InvalidArgument(field, f"must hold 1 to {most} configurations, but got {len(messages)}")
    found, configs = [], []
    for index, message in enumerate(messages):
        values = {"batch": message.batch, "threads": message.threads or 1, "opt_level": message.opt_level or "all",
                  "execution_mode": message.execution_mode or "sequential", "precision": message.precision or "fp32"}
        bad = []
        for name, allowed in (("opt_level", OPT_LEVELS), ("execution_mode", EXECUTION_MODES),
                              ("precision", PRECISIONS)):
            if values[name] not in allowed:
                bad.append((f"{field}[{index}].{name}", f"must be one of {', '.join(allowed)}, "
                                                         f"but got {values[name]!r}"))
        for name in ("batch", "threads"):
            if values[name] < 1:
                bad.append((f"{field}[{index}].{name}", f"must be >= 1, but got {values[name]}"))
        found += bad
        if not bad:
            configs.append(ServingConfig(**values))
    if found:
        raise InvalidArgument.of(found)
    return configs


def serving_sample(sample: Sample) -> pb.ServingSample:
    return pb.ServingSample(config=serving_config(sample.config), latency_ms=sample.latency_ms,
                            throughput_rps=sample.throughput_rps)


def serving_measurements(name: str, kind: str, samples: list[Sample]) -> pb.ServingMeasurements:
    ordered = sorted(samples, key=lambda s: (s.config.precision, s.config.batch, s.config.threads,
                                             s.config.opt_level, s.config.execution_mode))
    return pb.ServingMeasurements(name=name, pool_kind=kind, samples=[serving_sample(s) for s in ordered])


def serving_performance(name: str, kind: str, predictions: list[Sample], fit: Fit) -> pb.ServingPerformance:
    return pb.ServingPerformance(
        name=name, pool_kind=kind, predictions=[serving_sample(s) for s in predictions],
        fit=pb.PerformanceModelFit(method=fit.method, learned_on=fit.learned_on, source_samples=fit.source_samples,
                                   target_samples=fit.target_samples))
