"""Run the inference-router service: ``python -m opml_inference_router`` (configured by OPML_* variables).

One gRPC server carries the KServe v2 inference API (tritonclient and other KServe clients call
it) and the DeploymentService; the native front (:mod:`.native_front`) serves the inference API
alone on ``inference_port`` for a fraction of the CPU per call. The router starts its worker processes (the fleet file's pools that
this machine can run), rebuilds the deployments Redis remembers, publishes predictions and
deployment events, deploys committed bundles tagged ``serve=true`` from the bundles topic, and keeps
the monitoring-scorer's window quality (``opml.quality.v1``) for the rollouts' quality checks.
SIGTERM: the server drains, then the consumer, the predictions and the workers stop.

With ``replicated`` several routers share Redis and the topics (:mod:`.leadership`): each serves
inference from its own workers; the holder of the ``inference-router`` lease deploys, re-places,
drives rollouts, autodeploys and places on hosts, and the others mirror what it stores and forward
the deployment and host APIs to it (:mod:`.leader_calls`).
"""

from __future__ import annotations

import dataclasses
import secrets
from functools import partial

from opml.inference.v1 import deployments_pb2_grpc, hosts_pb2, hosts_pb2_grpc

from opml_common.bus import EventConsumer, RedisDeduplicator
from opml_common.grpc.server import ServiceRegistration
from opml_common.lease import LeaderLease
from opml_common.process import ServiceSpec
from opml_common.service import ServiceContext, run_service
from opml_inference_router import frontend
from opml_inference_router.control import DeploymentManager, DeploymentStore, Observer, PoolManager
from opml_inference_router.control.autodeploy import GROUP, SOURCES, AutoDeployer
from opml_inference_router.control.bundles import BundleFetcher
from opml_inference_router.control.decisions import DecisionLedger
from opml_inference_router.control.progressive import Mirrors, ProgressiveRollouts, RolloutStore
from opml_inference_router.control.quality import GROUP as QUALITY_GROUP
from opml_inference_router.control.quality import SOURCES as QUALITY_SOURCES
from opml_inference_router.control.quality import QualityBook, QualityConsumer
from opml_inference_router.control.replica_measures import MeasuresReporter, ReplicaMeasures
from opml_inference_router.control.scorer_windows import ScorerWindows
from opml_inference_router.control.worker_metrics import register_worker_metrics  # workers' metrics on ours
from opml_inference_router.data_plane import DirectPlane
from opml_inference_router.hosts.registry import HostRegistry
from opml_inference_router.hosts.service import HostServicer
from opml_inference_router.hosts.wiring import bundle_bytes, connect_hosts
from opml_inference_router.leader_calls import LeaderCalls
from opml_inference_router.leadership import LEASE, ConsumerPart, RouterLeadership
from opml_inference_router.native_front import FrontLink, NativeFront
from opml_inference_router.placement import CostAwareSloPolicy, SiteRule, load_fleet_config
from opml_inference_router.predictions import PredictionLog
from opml_inference_router.routing import Router
from opml_inference_router.routing.uds_replica import connect
from opml_inference_router.servicer import METHOD_ROLES, DeploymentServicer
from opml_inference_router.settings import RouterSettings
from opml_inference_router.topics import BUNDLES
from opml_inference_router.worker.settings import WorkerSettings
from opml_inference_router_contract.names import SERVICE
from opml_inference_router_contract.topics import DEPLOYMENTS, PREDICTIONS
from opml_monitoring_scorer_contract.topics import QUALITY

SPEC = ServiceSpec(name=SERVICE, module="opml_inference_router", settings=RouterSettings,
                   other_settings=(WorkerSettings,), topics=(BUNDLES, QUALITY, PREDICTIONS, DEPLOYMENTS))


async def build(service: ServiceContext) -> list[ServiceRegistration]:
    """Workers, router, prediction log, deployments (rebuilt from Redis) and autodeploy, started in that
    order and stopped in reverse after the server drains; above all the worker pools are stopped even
    when another part fails to (their processes run in sessions of their own and would outlive us)."""
    settings: RouterSettings = service.settings
    platform, metrics = service.platform, service.metrics
    token = settings.worker_token.get_secret_value() or secrets.token_urlsafe(24)
    pools = await service.start(PoolManager(
        load_fleet_config(settings.fleet_path), settings.fleet_path, work_dir=settings.home, metrics=metrics,
        token=token, threads_per_replica=settings.worker_threads_per_replica,
        startup_timeout_s=settings.worker_startup_timeout_s, route_over_uds=settings.worker_transport == "uds"))
    register_worker_metrics(pools, metrics)  # workers' /metrics re-exported on the router's (control/worker_metrics.py)
    hosts = HostRegistry(pools.fleet, worker_token=token, metrics=metrics,
                         bundle_bytes=lambda model: bundle_bytes(manager.models, model),  # the site rule weighs them
                         rule=SiteRule(settings.site_transfer_slo_factor, settings.site_route_slo_fraction),
                         heartbeat_interval_s=settings.host_heartbeat_interval_s,
                         host_timeout_s=settings.host_timeout_s, probe_interval_s=settings.site_probe_interval_s)
    pools.attach_hosts(hosts)
    router = Router(connect=hosts.connector(partial(connect, token=token)), metrics=metrics,
                    max_request_bytes=settings.max_request_bytes, max_receive_bytes=settings.grpc_max_receive_bytes)
    service.on_stop(router.close)
    predictions = await service.start(PredictionLog(await service.publisher(), metrics,
                                                     senders=settings.prediction_senders,
                                                     batch_max=settings.prediction_batch_max,
                                                     batch_max_bytes=settings.prediction_batch_max_bytes,
                                                     in_flight_per_version=settings.prediction_in_flight_per_version,
                                                     linger_s=settings.prediction_linger_ms / 1000.0))
    bundle_token = settings.bundle_store_token.get_secret_value() or None
    fetcher = BundleFetcher(settings.bundle_store_target, settings.home, token=bundle_token)
    fetcher.remove_leftovers()
    service.on_stop(fetcher.close)  # after the deployments and autodeploy that fetch through it
    redis, prefix = service.redis(), platform.redis_prefix
    lease = LeaderLease(redis, LEASE, settings.advertised_target, prefix=prefix, ttl_s=settings.lease_ttl_s,
                        on_change=lambda leading: leadership.changed(leading)) if settings.replicated else None
    manager = await service.start(DeploymentManager(
        pools=pools, router=router, observer=Observer(metrics.registry), fetcher=fetcher,
        store=DeploymentStore(redis, prefix=prefix, fence=(lambda: lease.fence) if lease is not None else None),
        events=await service.emitter(), replan_interval_s=settings.replan_interval_s, usable=hosts.refusal,
        policy=CostAwareSloPolicy(site_rtt_ms=hosts.site_rtt_ms), following=settings.replicated,
        follow_interval_s=settings.follow_interval_s))
    connect_hosts(hosts, manager)
    await service.start(hosts)
    quality = QualityBook(redis, prefix=prefix)
    rollout_store = RolloutStore(redis, prefix=prefix, fence=(lambda: lease.fence) if lease is not None else None)
    rollouts = ProgressiveRollouts(
        manager, store=rollout_store, events=await service.emitter(),
        measures=ReplicaMeasures(router, redis, prefix=prefix) if lease is not None else None,
        quality=quality, ledger=DecisionLedger(settings.bundle_store_target, token=bundle_token), metrics=metrics,
        scorer=ScorerWindows(settings.monitoring_scorer_target,
                             token=settings.monitoring_scorer_token.get_secret_value() or None)
        if settings.monitoring_scorer_target else None)
    if settings.rollout_quality:
        scores = EventConsumer(platform, group_id=QUALITY_GROUP, topics=[QUALITY], sources=QUALITY_SOURCES,
                               handler=QualityConsumer(quality), metrics=metrics, publisher=await service.publisher(),
                               dedup=RedisDeduplicator(service.redis(), prefix=platform.redis_prefix,
                                                       group=QUALITY_GROUP))
        service.run_in_background(scores.run, stop=scores.stop, name="rollout-quality")
    publisher = await service.publisher()

    def autodeploy() -> EventConsumer:
        return EventConsumer(platform, group_id=GROUP, topics=[BUNDLES], sources=SOURCES,
                             handler=AutoDeployer(manager, bundles=fetcher), metrics=metrics, publisher=publisher,
                             dedup=RedisDeduplicator(redis, prefix=prefix, group=GROUP))

    if lease is None:  # one router: it leads from its start
        await service.start(rollouts)
        if settings.autodeploy:
            consumer = autodeploy()
            service.run_in_background(consumer.run, stop=consumer.stop, name="autodeploy")
    else:  # what only the leader runs; stopped in reverse: the tenure's parts before the lease is released
        tenure = [rollouts, *([ConsumerPart(autodeploy, name="autodeploy")] if settings.autodeploy else [])]
        leadership = RouterLeadership(lease=lease, redis=redis, prefix=prefix, manager=manager, hosts=hosts,
                                      parts=tenure, metrics=metrics)
        await service.start(lease)
        await service.start(leadership)
        await service.start(MeasuresReporter(router, redis, prefix=prefix, store=rollout_store, mirrors=Mirrors(manager),
                                             replica=settings.advertised_target, leading=leadership.leading))
    inference = frontend.InferenceFrontend(router, predictions=predictions)
    service.on_draining(lambda: setattr(inference, "accepting", False))
    if settings.native_front:
        plane = None
        if settings.direct_data_plane:
            plane = DirectPlane(router, predictions=predictions, metrics=metrics, auth=bool(platform.tokens()))
            await service.start(plane)
        await service.start(NativeFront(
            FrontLink(inference, tokens=platform.tokens(), metrics=metrics, plane=plane), host=settings.host,
            port=settings.inference_port, max_receive_bytes=settings.grpc_max_receive_bytes,
            grace_s=settings.shutdown_grace_s, tls=platform, metrics=metrics,
            control_hint=f"DeploymentService and the rest are on port {settings.grpc_port}"))
    deployments = DeploymentServicer(manager, allow_model_dir=platform.env == "dev",
                                     serving_models=manager.serving_models, rollouts=rollouts)  # measurements re-place what they change
    host_service = HostServicer(hosts, await service.publisher(), host_tokens=[
        t.strip() for t in settings.host_tokens.get_secret_value().split(",") if t.strip()])
    control = [deployments.registration(), host_service.registration()]
    if lease is not None:  # a follower forwards them to the leader
        control = [dataclasses.replace(control[0], servicer=LeaderCalls(
                       deployments, deployments_pb2_grpc.DeploymentServiceStub, frozenset(METHOD_ROLES),
                       leading=leadership.leading, leader=leadership.leader, me=settings.advertised_target)),
                   dataclasses.replace(control[1], servicer=LeaderCalls(
                       host_service, hosts_pb2_grpc.HostServiceStub,
                       frozenset(hosts_pb2.DESCRIPTOR.services_by_name["HostService"].methods_by_name),
                       leading=leadership.leading, leader=leadership.leader, me=settings.advertised_target))]
    return [inference.registration(), *control]


def main() -> None:
    run_service(SPEC, build)


if __name__ == "__main__":
    main()
