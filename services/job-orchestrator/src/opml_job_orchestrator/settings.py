"""job-orchestrator settings: ``OPML_JOB_ORCHESTRATOR_*`` (the shared ones are in opml_common.config).

The cluster the scheduler packs jobs onto is ``NODES``, a JSON list such as
``[{"name": "gpu-0", "cpu_millis": 64000, "memory_mib": 515000, "gpu": 8}, ...]``; by default one
node, this machine, with its cores, memory and CUDA devices (none where nvidia-smi finds none).

``EXECUTOR`` picks what runs the tasks: ``local`` processes (the embedded default) or
``kubernetes`` pods, configured by the ``K8S_*`` settings (an image is required, and ``NODES``
must name the Kubernetes nodes, since jobs are pinned to the nodes the scheduler picks).
``SANDBOX`` and ``SANDBOX_UID_*`` say how local tasks are sandboxed (each job as a user of its own;
see ``executor/sandbox.py``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from opml_common.config import PlatformSettings, ServiceSettings
from opml_common.gpus import GpuDevice, discover
from opml_job_orchestrator.executor.sandbox import DEFAULT_UID_BASE, DEFAULT_UID_COUNT, MAX_UID


class NodeConfig(BaseModel):
    """One node of the cluster and what it offers to jobs."""

    model_config = {"frozen": True, "extra": "forbid"}

    name: str = Field(min_length=1)
    cpu_millis: int = Field(ge=0)
    memory_mib: int = Field(ge=0)
    gpu: int = Field(0, ge=0)


def this_machine(devices: Sequence[GpuDevice] | None = None) -> list[NodeConfig]:
    """One node: this machine's cores, physical memory and CUDA devices (``devices``, default the
    ones :func:`opml_common.gpus.discover` finds: the local executor hands out the same)."""
    memory_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2 ** 20
    gpus = len(discover() if devices is None else devices)
    return [NodeConfig(name="local", cpu_millis=(os.cpu_count() or 1) * 1000, memory_mib=memory_mib, gpu=gpus)]


class JobOrchestratorSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="OPML_JOB_ORCHESTRATOR_", frozen=True, extra="ignore")

    grpc_port: int = Field(50052, ge=0, le=65535, description="gRPC port (0 picks a free one).")
    metrics_port: int = Field(9152, ge=0, le=65535, description="Prometheus /metrics port (0 picks a free one).")
    home: Path = Field(Path.home() / ".opml" / "job-orchestrator",
                       description="Directory of the jobs' work (logs, run manifests) and the event outbox.")
    nodes: list[NodeConfig] | None = Field(None, min_length=1, description="The cluster: a JSON list of "
                                           "{name, cpu_millis, memory_mib, gpu}; unset: this machine (its cores, "
                                           "memory and the CUDA devices nvidia-smi finds).")
    policy: Literal["fifo", "fifo+backfill", "te-be", "te-be+backfill", "te-be+"] = Field(
        "te-be+", description="Scheduling policy preset (see the README's Policies).")
    max_retries: int = Field(3, ge=0, description="Retries of a failed run when the job spec sets none.")
    retry_base_delay_s: float = Field(1.0, ge=0, description="Delay before the first retry; doubles each time.")
    retry_max_delay_s: float = Field(60.0, ge=0, description="Longest delay between retries.")
    terminate_grace_s: float = Field(30.0, ge=0, description="SIGTERM-to-kill grace of a preempted or cancelled "
                                     "run (time for a BE job to write its checkpoint).")
    watch_backlog: int = Field(1000, ge=1, description="Changes a watch stream may fall behind before it is ended.")
    log_poll_s: float = Field(0.2, gt=0, description="How often `logs --follow` looks for new output (and a "
                              "follower's WatchJobs for changed jobs).")
    lease_ttl_s: float = Field(10.0, ge=1, le=300, description="The job-orchestrator leader lease's TTL: the "
                               "replica holding it schedules the jobs and runs the pipelines; after a leader "
                               "dies (no clean release) another replica takes over within this long. It is "
                               "renewed every third.")
    forward_timeout_s: float = Field(10.0, gt=0, le=120, description="How long a follower waits for the leader "
                                     "to carry out a change it handed over (submit, cancel, a pipeline's apply) "
                                     "before it answers UNAVAILABLE.")
    executor: Literal["local", "kubernetes"] = Field(
        "local", description="What runs jobs' tasks: `local` processes, or `kubernetes` pods (the K8S_* settings).")
    k8s_namespace: str = Field("default", min_length=1, description="Namespace of the jobs' pods and Services.")
    k8s_image: str | None = Field(None, min_length=1, description="Container image of every task (the jobs' code, "
                                  "TensorFlow, and the trace collector for traced jobs); required for kubernetes.")
    k8s_kubeconfig: Path | None = Field(None, description="Kubeconfig file to reach the API server; unset: the "
                                        "in-cluster service account (the orchestrator runs in the cluster).")
    k8s_context: str | None = Field(None, min_length=1,
                                    description="Context of the kubeconfig (unset: its current one).")
    k8s_service_account: str | None = Field(None, min_length=1, description="Service account of the jobs' pods "
                                            "(unset: the namespace's default).")
    k8s_checkpoint_claim: str | None = Field(None, min_length=1, description="PersistentVolumeClaim mounted at a "
                                             "job's checkpoint dir, so a resumed run on another node finds it.")
    k8s_pipeline_claim: str | None = Field(None, min_length=1, description="PersistentVolumeClaim (ReadWriteMany) "
                                           "mounted at `pipeline_dir` in every pod, where the pipelines' steps' "
                                           "jobs read and write their folders; the service mounts it at "
                                           "`pipeline_dir` too (unset: pipeline steps cannot run in pods).")
    k8s_env_secret: str | None = Field(None, min_length=1, description="Secret whose keys every pod gets as "
                                       "variables: the jobs' own scoped credentials (OPML_S3_ACCESS_KEY and "
                                       "OPML_S3_SECRET_KEY of the job identity, OPML_REDIS_URL of the job Redis "
                                       "user), never the platform's; no credential is written into a pod spec.")
    k8s_node_label: str | None = Field("kubernetes.io/hostname", description="Node label that pins each pod to "
                                       "the node the scheduler chose (empty: let Kubernetes place pods).")
    k8s_poll_interval_s: float = Field(2.0, gt=0, description="How often the executor lists the jobs' pods.")
    k8s_run_as_user: int = Field(1000, ge=1, le=MAX_UID, description="Non-root uid (and gid) the jobs' "
                                 "containers run as; the image's Python and the job's code must be readable "
                                 "by it, and the checkpoint claim writable (the pod's fsGroup).")
    sandbox: Literal["auto", "required", "off"] = Field(
        "auto", description="Local tasks run sandboxed: each job as a uid of its own (no_new_privs, umask 077), "
        "its /proc listing only its own processes, in folders of its own. `auto`: when the service runs as "
        "root and the sandbox works here, else unsandboxed with a warning; `required`: refuse to start "
        "without it; `off`: as the service's user (development only).")
    sandbox_uid_base: int = Field(DEFAULT_UID_BASE, ge=1, le=MAX_UID, description="First uid (and gid) given "
                                  "to jobs' tasks; the range must hold no user of the machine.")
    sandbox_uid_count: int = Field(DEFAULT_UID_COUNT, ge=1, description="How many uids jobs get: one per job, "
                                   "kept for every attempt of it.")
    job_s3_access_key: SecretStr | None = Field(None, description="Access key of the S3 identity jobs get (as "
                                                "OPML_S3_ACCESS_KEY): a dedicated identity limited to the trace "
                                                "bucket (and a checkpoint bucket, if jobs use one), never the "
                                                "platform's. Unset: jobs get no S3 credentials.")
    job_s3_secret_key: SecretStr | None = Field(None, description="Secret key of that job identity "
                                                "(OPML_S3_SECRET_KEY in the job); set with job_s3_access_key.")
    job_redis_url: SecretStr | None = Field(None, description="Redis URL jobs get (OPML_REDIS_URL), for the "
                                            "tracer's capture control: a Redis ACL user that may only read "
                                            "`{redis_prefix}traces:*`, never the platform's URL. Unset: jobs get "
                                            "no Redis URL (traced jobs then cannot be armed for captures).")
    job_kafka_sasl_username: str | None = Field(None, min_length=1, description="SASL user jobs' tracers "
                                                "publish trace events as (ACLs: write the traces topic only); "
                                                "passed only where the platform's settings have a "
                                                "`kafka_sasl_username`. Unset: jobs get no Kafka credential.")
    job_kafka_sasl_password: SecretStr | None = Field(None, description="Password of that SASL user.")

    bundle_store_target: str = Field(
        "127.0.0.1:50051", min_length=1,
        validation_alias=AliasChoices("OPML_JOB_ORCHESTRATOR_BUNDLE_STORE_TARGET", "OPML_BUNDLE_STORE_TARGET"),
        description="host:port of the bundle-store, where pipelines read spans and write their steps' outputs "
        "(also read from OPML_BUNDLE_STORE_TARGET).")
    bundle_store_token: SecretStr = Field(SecretStr(""), description="Bearer token (writer role) pipelines call "
                                          "the bundle-store with; empty: none (dev). Never given to jobs.")
    monitoring_scorer_target: str = Field(
        "127.0.0.1:50056", min_length=1,
        validation_alias=AliasChoices("OPML_JOB_ORCHESTRATOR_MONITORING_SCORER_TARGET", "OPML_MONITORING_SCORER_TARGET"),
        description="host:port of the monitoring-scorer, where an alert that would start a pipeline run is "
        "re-read (also read from OPML_MONITORING_SCORER_TARGET).")
    monitoring_scorer_token: SecretStr = Field(SecretStr(""), description="Bearer token (reader role) for the "
                                               "monitoring-scorer; empty: none (dev).")
    pipeline_dir: Path = Field(Path(tempfile.gettempdir()) / "opml-pipelines", description="Folder of the "
                               "pipeline steps' folders, which their sandboxed jobs read and write (outside "
                               "`home`, which jobs cannot enter).")
    pipeline_triggers: bool = Field(True, description="Start pipeline runs on committed spans (opml.bundles.v1) "
                                    "and alerts (opml.alerts.v1); off: by the API and schedules only.")
    pipeline_step_cpu_millis: int = Field(1000, ge=1, description="CPU of a validate or evaluate step's job.")
    pipeline_step_memory_mib: int = Field(1024, ge=1, description="Memory of a validate or evaluate step's job.")
    pipeline_max_parallel_steps: int = Field(4, ge=1, le=64, description="How many steps of one pipeline run may go "
                                             "at once (those whose inputs have all ended; validate steps one at a "
                                             "time).")

    def cluster_nodes(self) -> list[NodeConfig]:
        """The configured nodes, or this machine."""
        return self.nodes or this_machine()

    @model_validator(mode="after")
    def _checks(self) -> JobOrchestratorSettings:
        names = [node.name for node in self.nodes or ()]
        if len(set(names)) != len(names):
            raise ValueError(f"nodes must have unique names, but got {names}")
        if self.retry_max_delay_s < self.retry_base_delay_s:
            raise ValueError("retry_max_delay_s must be >= retry_base_delay_s")
        if self.sandbox_uid_base + self.sandbox_uid_count - 1 > MAX_UID:
            raise ValueError(f"sandbox_uid_base + sandbox_uid_count - 1 must be at most {MAX_UID}")
        if (self.job_s3_access_key is None) != (self.job_s3_secret_key is None):
            raise ValueError("job_s3_access_key and job_s3_secret_key must be set together (the job identity)")
        if (self.job_kafka_sasl_username is None) != (self.job_kafka_sasl_password is None):
            raise ValueError("job_kafka_sasl_username and job_kafka_sasl_password must be set together")
        if self.executor == "kubernetes":
            if self.k8s_image is None:
                raise ValueError("k8s_image must be set when executor is kubernetes (the image every task runs)")
            if self.nodes is None:
                raise ValueError("nodes must list the Kubernetes nodes when executor is kubernetes (this machine "
                                 "is not a node of the cluster)")
        return self

    @field_validator("k8s_node_label", "k8s_kubeconfig", "k8s_context", "k8s_service_account", "k8s_checkpoint_claim",
                     "k8s_pipeline_claim", "k8s_env_secret", "job_s3_access_key", "job_s3_secret_key", "job_redis_url",
                     "job_kafka_sasl_username", "job_kafka_sasl_password", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        """An empty variable unsets the setting (`K8S_NODE_LABEL=` leaves placing pods to Kubernetes)."""
        return None if value == "" else value


JOB_PLATFORM_VARIABLES = ("kafka_bootstrap", "kafka_idempotence", "kafka_replication_factor", "topic_prefix",
                          "s3_endpoint", "s3_region", "redis_prefix", "log_format")
"""The platform settings a job gets as they are: where the broker and S3 are, the names' prefixes.
Never ``env`` (a job is no service: ``prod``'s checks would ask it for the platform's tokens), never
a credential. Other non-secret ``kafka_*`` settings (a SASL mechanism, a CA file) are passed too."""

_CREDENTIAL_WORDS = ("password", "secret", "username", "token", "key", "cert", "url")


def platform_env(platform: PlatformSettings, settings: JobOrchestratorSettings | None = None, *,
                 credentials: bool = True) -> dict[str, str]:
    """The ``OPML_*`` variables a job's tasks get from the platform: :data:`JOB_PLATFORM_VARIABLES`
    and the platform's other non-secret ``kafka_*`` settings, as the service sees them (the trace
    collector's tracer reads them), then, with ``credentials``, the job's own scoped credentials from
    ``settings`` (``job_s3_*``, ``job_redis_url``, ``job_kafka_sasl_*``), under the names the tracer
    reads. Never the platform's tokens, S3 keys, Redis URL or Kafka password: a job runs whatever
    its submitter wrote, and a writer must not get more than a job needs. Pods get the credentials
    from ``K8S_ENV_SECRET`` instead (``credentials=False``)."""
    names = list(JOB_PLATFORM_VARIABLES)
    for name, info in type(platform).model_fields.items():
        if (name.startswith("kafka_") and name not in names and info.annotation is not SecretStr
                and "SecretStr" not in str(info.annotation) and not any(w in name for w in _CREDENTIAL_WORDS)):
            names.append(name)
    env = {}
    for name in names:
        value = getattr(platform, name)
        if value is None or hasattr(value, "get_secret_value"):
            continue
        env[f"OPML_{name.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
    if credentials and settings is not None:
        env.update(job_credentials(platform, settings))
    return env


def job_credentials(platform: PlatformSettings, settings: JobOrchestratorSettings) -> dict[str, str]:
    """The job's own scoped credentials from ``settings``, as the variables the tracer reads."""
    env: dict[str, str] = {}
    if settings.job_s3_access_key is not None and settings.job_s3_secret_key is not None:
        env["OPML_S3_ACCESS_KEY"] = settings.job_s3_access_key.get_secret_value()
        env["OPML_S3_SECRET_KEY"] = settings.job_s3_secret_key.get_secret_value()
    if settings.job_redis_url is not None:
        env["OPML_REDIS_URL"] = settings.job_redis_url.get_secret_value()
    if settings.job_kafka_sasl_username is not None and settings.job_kafka_sasl_password is not None:
        fields = type(platform).model_fields
        if "kafka_sasl_username" not in fields or "kafka_sasl_password" not in fields:
            raise ValueError("job_kafka_sasl_username is set, but the platform's settings have no "
                             "kafka_sasl_username/kafka_sasl_password for a job's tracer to read it from")
        env["OPML_KAFKA_SASL_USERNAME"] = settings.job_kafka_sasl_username
        env["OPML_KAFKA_SASL_PASSWORD"] = settings.job_kafka_sasl_password.get_secret_value()
    return env
