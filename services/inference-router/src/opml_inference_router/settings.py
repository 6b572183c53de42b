"""inference-router settings: ``OPML_INFERENCE_ROUTER_*`` (the shared ones are in opml_common.config).

The worker processes the router starts have their own ``OPML_INFERENCE_ROUTER_WORKER_*`` settings
(:mod:`opml_inference_router.worker.settings`); the router passes them what they need as flags.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import SettingsConfigDict

from opml_common.config import ServiceSettings
from opml_inference_router.routing.limits import DEFAULT_GRPC_MAX_RECEIVE_BYTES, DEFAULT_MAX_REQUEST_BYTES

# The fleet of one machine, shipped inside the package so installed (non-editable) copies have it too.
LOCAL_FLEET = Path(__file__).resolve().parent / "fleet-local.yaml"


class RouterSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="OPML_INFERENCE_ROUTER_", frozen=True, extra="ignore")

    grpc_port: int = Field(50053, ge=0, le=65535, description="gRPC port of the KServe v2 and deployment APIs "
                                                              "(0 picks a free one).")
    metrics_port: int = Field(9153, ge=0, le=65535, description="Prometheus /metrics port (0 picks a free one).")
    home: Path = Field(Path.home() / ".opml" / "inference-router",
                       description="Work directory: fetched bundles, worker logs, the event outbox.")
    fleet: Path | None = Field(None, description="Fleet file: the pool kinds and the pools of local workers to "
                               "start (kinds whose execution provider is missing are skipped); unset: the package's "
                               "fleet-local.yaml (2 cpu workers, 1 emulated int8 accel worker, gpu where CUDA is).")
    bundle_store_target: str = Field(
        "127.0.0.1:50051", validation_alias=AliasChoices("OPML_INFERENCE_ROUTER_BUNDLE_STORE_TARGET",
                                                         "OPML_BUNDLE_STORE_TARGET"),
        description="host:port of the bundle-store service (also read from OPML_BUNDLE_STORE_TARGET, which "
                    "the CLI uses).")
    bundle_store_token: SecretStr = Field(SecretStr(""), description="Bearer token for the bundle-store: the "
                                          "reader role fetches bundles; the writer role also records each rollout "
                                          "decision in the deployed bundle's lineage (with a reader token those "
                                          "writes are refused and logged); empty: none.")
    rollout_quality: bool = Field(True, description="Consume the monitoring-scorer's window quality "
                                  "(opml.quality.v1, group inference-router-quality) for the rollouts' "
                                  "estimated_accuracy and accuracy checks; false: those checks stay inconclusive.")
    monitoring_scorer_target: str = Field(
        "127.0.0.1:50056", validation_alias=AliasChoices("OPML_INFERENCE_ROUTER_MONITORING_SCORER_TARGET",
                                                         "OPML_MONITORING_SCORER_TARGET"),
        description="host:port of the monitoring-scorer, whose windows are read again before a rollout is "
        "aborted on its numbers (also read from OPML_MONITORING_SCORER_TARGET); unreachable: such a check is "
        "inconclusive; empty: the events' numbers are acted on as they are.")
    monitoring_scorer_token: SecretStr = Field(SecretStr(""), description="Bearer token (reader role) for the "
                                               "monitoring-scorer; empty: none (dev).")
    native_front: bool = Field(
        True, description="Serve KServe v2 inference also on `inference_port` from the native gRPC front "
        "(native/front.cc, built by `make install`), which costs a fraction of the router's Python gRPC server "
        "per call (docs/benchmarks.md); false: inference only on `grpc_port`.")
    direct_data_plane: bool = Field(
        True, description="The native front sends ModelInfer calls of a model that one version serves (no "
        "canary split, no shadow) straight to a local worker, with the route, admission tokens, hedging and auth "
        "verdicts the router pushes it, and reports each call back for the prediction log and metrics "
        "(opml_inference_router.data_plane; docs/benchmarks.md, serving tail); false: every call goes through the "
        "router's event loop.")
    inference_port: int = Field(8001, ge=0, le=65535, description="The native front's gRPC port (Triton's "
                                "default; 0 picks a free one): inference.GRPCInferenceService only.")
    worker_token: SecretStr = Field(
        SecretStr(""), description="Bearer token the router and its workers share (workers accept only it); "
        "empty: a random one per start.")
    worker_threads_per_replica: int = Field(0, ge=0, description="Intra-op threads per replica on the workers "
                                                                 "(0: a worker's cores / its kind's slots).")
    worker_transport: Literal["uds", "grpc"] = Field(
        "uds", description="How the router calls its local workers: `uds`, a lean framed protocol on a Unix "
        "socket (~0.2 ms a hop), or `grpc` over TCP (~0.7 ms); admin calls and health always use gRPC.")
    worker_startup_timeout_s: float = Field(60.0, gt=0, description="How long a worker may take to serve.")
    replan_interval_s: float = Field(30.0, ge=0, description="Seconds between checks of measured rate and p99 "
                                                             "against the plan (0: never re-place).")
    autodeploy: bool = Field(True, description="Deploy committed bundles tagged serve=true from the bundles topic.")
    prediction_senders: int = Field(
        64, ge=1, le=1024, description="Concurrent publishes of the prediction log. Each waits for the broker's "
        "ack, so throughput is senders / ack latency: 8 gave ~1.2k predictions/s on the durable embedded broker, "
        "below the router's ~2.3k inferences/s, and 64 gave ~2.2-2.9k (docs/benchmarks.md, broker storage).")
    prediction_batch_max: int = Field(
        100, ge=1, le=10_000, description="Most predictions of one model version a prediction sender publishes in "
        "one record (an opml.inference.v1.PredictionBatch): what is queued for the version when a sender takes it, "
        "after `prediction_linger_ms` or at once when this many are queued (one queued: a PredictionMade). A consumer's costs are per record, so this is what "
        "lets the monitoring-scorer keep up with one-row requests above a few thousand per second "
        "(docs/benchmarks.md, monitoring-scorer); 1: one PredictionMade per request.")
    prediction_batch_max_bytes: int = Field(
        512 * 1024, ge=1024, le=1024 * 1024 - 64 * 1024, description="Most bytes of recorded KServe messages (plus "
        "~256 a prediction) in one prediction record; below the broker's and the producer's 1 MiB record limit.")
    prediction_in_flight_per_version: int = Field(
        4, ge=1, le=1024, description="Most prediction records of one model version being published at once (of "
        "`prediction_senders` for all). While they are at the broker the version's new predictions queue and "
        "the next record takes them all, so records carry about rate x ack latency / this many predictions; "
        "higher: smaller records, more of them (a consumer's cost is per record). A version's throughput is at "
        "most this x `prediction_batch_max` / the ack latency.")
    prediction_linger_ms: float = Field(
        50.0, ge=0, le=10_000, description="How long a model version's queued predictions wait for others to share "
        "their record, unless `prediction_batch_max` of them are queued (Kafka's linger.ms). Each record costs a "
        "producer send, a broker write and an ack on the cores that serve; without it a router below a few thousand "
        "requests a second published about one record a request, a third of its event loop (docs/benchmarks.md, "
        "serving tail). 0: publish at once.")

    max_request_bytes: int = Field(
        DEFAULT_MAX_REQUEST_BYTES, ge=1, description="Longest ModelInferRequest (serialized bytes) the router "
        "forwards for a model whose config fixes no size (a BYTES input or a -1 dim) and sets no "
        "`max_request_bytes`; a model with fixed-size inputs gets max_batch_size x dims x item size + 64 KiB. "
        "Longer requests are refused with INVALID_ARGUMENT before they are copied or forwarded.")
    grpc_max_receive_bytes: int = Field(
        DEFAULT_GRPC_MAX_RECEIVE_BYTES, ge=1024, le=(1 << 31) - 1, description="The router's gRPC server max "
        "receive message length (below the platform's 64 MiB) and the ceiling of every model's request limit: "
        "gRPC refuses a longer message itself (RESOURCE_EXHAUSTED) before assembling it. Receiving a message "
        "holds the router's event loop ~1.5 ms per MB, so this bounds what one request can stall the other "
        "models by; raise it only for models whose requests need it.")

    host_tokens: SecretStr = Field(SecretStr(""), description="Comma-separated bearer tokens of worker host agents "
                                   "(opml-inference-host): each may register a host, heartbeat and forward its "
                                   "predictions, nothing else. Empty: only admin tokens may (dev: anyone).")
    host_heartbeat_interval_s: float = Field(1.0, gt=0, description="How often a host agent heartbeats.")
    host_timeout_s: float = Field(3.0, gt=0, description="A host silent this long is lost: its replicas are marked "
                                  "down at once and re-placed on other workers. More than the heartbeat interval.")
    site_probe_interval_s: float = Field(30.0, gt=0, description="How often the router measures each host's link "
                                         "(round trip, bandwidth) for placement.")
    site_transfer_slo_factor: float = Field(400.0, gt=0, description="A model goes to a site only if its bundle "
                                            "arrives within this x its p99 SLO (400: 10 s for a 25 ms SLO); "
                                            "see placement/sites.py.")
    site_route_slo_fraction: float = Field(0.5, gt=0, description="A model goes to a site only if the round trip "
                                           "to it is at most this x its p99 SLO.")

    replicated: bool = Field(
        False, description="Run as one of several router replicas sharing Redis and the topics: the holder of the "
        "inference-router lease writes the deployments, re-places, drives rollouts, autodeploys and places on hosts; "
        "the others serve inference from their own workers with the deployments it stores, and forward the "
        "deployment and host APIs to it. False: one router, which leads from its start.")
    lease_ttl_s: float = Field(10.0, gt=0, description="With `replicated`: the lease's time to live; a leader that "
                               "dies is succeeded within about this long.")
    advertise: str = Field("", description="With `replicated`: host:port at which the other replicas reach this one's "
                           "gRPC port (they forward control-plane calls to the leader there); empty: "
                           "<hostname>:`grpc_port`.")
    follow_interval_s: float = Field(0.5, gt=0, description="With `replicated`: how often a follower checks whether "
                                     "the stored deployments changed (it then mirrors them onto its workers).")

    @property
    def fleet_path(self) -> Path:
        return self.fleet or LOCAL_FLEET

    @property
    def advertised_target(self) -> str:
        return self.advertise or f"{socket.gethostname()}:{self.grpc_port}"
