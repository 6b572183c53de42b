"""The service's settings and the executor they select (no cluster is contacted: the API is the fake)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from opml_common.config import PlatformSettings
from opml_common.errors import FailedPrecondition
from opml_job_orchestrator.__main__ import build_executor
from opml_job_orchestrator.executor import JobProgram, LocalExecutor
from opml_job_orchestrator.executor.fake_kubernetes import FakeCoreV1Api
from opml_job_orchestrator.executor.kubernetes import KubernetesExecutor, pod_name
from opml_job_orchestrator.scheduler import JobClass, JobSpec, Resources, RoleSpec
from opml_job_orchestrator.settings import JobOrchestratorSettings, platform_env

NODES = json.dumps([{"name": "gpu-0", "cpu_millis": 8000, "memory_mib": 32768, "gpu": 1}])
PLATFORM = PlatformSettings(kafka_bootstrap="kafka:9092", topic_prefix="prod-", s3_secret_key="s3cret",
                            redis_url="redis://:pw@redis:6379/0")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    def set_env(**values: str) -> JobOrchestratorSettings:
        for key, value in {"HOME": str(tmp_path / "home"), **values}.items():
            monkeypatch.setenv(f"OPML_JOB_ORCHESTRATOR_{key}", value)
        return JobOrchestratorSettings()
    return set_env


def test_the_local_executor_is_the_default_and_gets_the_platform_env(env) -> None:
    settings = env()
    assert settings.executor == "local"
    executor = build_executor(settings, PLATFORM)
    assert isinstance(executor, LocalExecutor)
    assert executor._platform_env["OPML_KAFKA_BOOTSTRAP"] == "kafka:9092"
    # Issue 16: local tasks never get the platform's secrets, only the job identity's when one is set.
    assert "OPML_S3_SECRET_KEY" not in executor._platform_env and "OPML_REDIS_URL" not in executor._platform_env
    scoped = build_executor(env(JOB_S3_ACCESS_KEY="job-key", JOB_S3_SECRET_KEY="job-secret",
                                JOB_REDIS_URL="redis://job:pw@redis:6379/0"), PLATFORM)
    assert scoped._platform_env["OPML_S3_ACCESS_KEY"] == "job-key"
    assert scoped._platform_env["OPML_S3_SECRET_KEY"] == "job-secret"
    assert scoped._platform_env["OPML_REDIS_URL"] == "redis://job:pw@redis:6379/0"
    assert "s3cret" not in scoped._platform_env.values()


def test_the_sandbox_settings_reach_the_local_executor_and_are_validated(env, tmp_path: Path) -> None:
    assert build_executor(env(), PLATFORM)._sandbox_settings == ("auto", 2_000_000, 100_000, (tmp_path / "home",))
    executor = build_executor(env(SANDBOX="required", SANDBOX_UID_BASE="500000", SANDBOX_UID_COUNT="10"), PLATFORM)
    assert executor._sandbox_settings == ("required", 500_000, 10, (tmp_path / "home",))  # its home is protected
    for (mode, base, count), error in ((("on", "1", "1"), "sandbox"), (("off", "0", "1"), "sandbox_uid_base"),
                                       (("off", str(2**32 - 10), "100"),
                                        r"sandbox_uid_base \+ sandbox_uid_count - 1 must be at most 4294967294")):
        with pytest.raises(ValidationError, match=error):  # each variable set anew: they stay set
            env(SANDBOX=mode, SANDBOX_UID_BASE=base, SANDBOX_UID_COUNT=count)


@pytest.mark.parametrize(("values", "error"), [
    ({"EXECUTOR": "kubernetes", "NODES": NODES}, "k8s_image must be set"),
    ({"EXECUTOR": "kubernetes", "K8S_IMAGE": "trainer:1"}, "nodes must list the Kubernetes nodes"),
    ({"EXECUTOR": "slurm"}, "executor"),
    ({"EXECUTOR": "kubernetes", "K8S_IMAGE": "trainer:1", "NODES": NODES, "K8S_POLL_INTERVAL_S": "0"},
     "k8s_poll_interval_s"),
])
def test_kubernetes_settings_are_validated(env, values: dict[str, str], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        env(**values)


async def test_kubernetes_is_selected_by_settings_and_pods_follow_them(env, tmp_path: Path) -> None:
    settings = env(EXECUTOR="kubernetes", K8S_IMAGE="registry.example.com/trainer:1", K8S_NAMESPACE="ml",
                   K8S_SERVICE_ACCOUNT="trainer", K8S_CHECKPOINT_CLAIM="checkpoints", K8S_ENV_SECRET="opml-platform",
                   K8S_KUBECONFIG=str(tmp_path / "kubeconfig"), K8S_NODE_LABEL="", NODES=NODES, K8S_RUN_AS_USER="4242")
    assert settings.k8s_node_label is None
    api = FakeCoreV1Api()
    executor = build_executor(settings, PLATFORM, kubernetes_api=api)
    assert isinstance(executor, KubernetesExecutor)
    job = JobSpec(job_id="mnist", job_class=JobClass.BE, roles={"worker": RoleSpec(1, Resources(cpu_millis=100))})
    async with executor:  # the given API: the kubeconfig (which does not exist) is never read
        await executor.launch(job, JobProgram(commands={"worker": ["python", "train.py"]}, checkpoint_dir="/ckpt"),
                              {"worker": ("gpu-0",)}, attempt=0)
        pod = api.pods[pod_name("mnist", 0, "worker", 0)]
    assert pod["metadata"]["namespace"] == "ml" and "nodeSelector" not in pod["spec"]
    assert pod["spec"]["serviceAccountName"] == "trainer"
    assert pod["spec"]["volumes"][-1] == {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "checkpoints"}}
    assert pod["spec"]["securityContext"]["runAsUser"] == 4242 and pod["spec"]["securityContext"]["runAsNonRoot"]
    container = pod["spec"]["containers"][0]
    assert container["image"] == "registry.example.com/trainer:1"
    assert container["envFrom"] == [{"secretRef": {"name": "opml-platform"}}]
    env_vars = {e["name"]: e["value"] for e in container["env"]}
    assert env_vars["OPML_KAFKA_BOOTSTRAP"] == "kafka:9092" and env_vars["OPML_TOPIC_PREFIX"] == "prod-"
    assert not {"OPML_S3_SECRET_KEY", "OPML_S3_ACCESS_KEY", "OPML_REDIS_URL"} & set(env_vars)  # from the Secret



async def test_the_pipeline_claim_is_mounted_at_the_pipeline_dir_in_every_pod(env, tmp_path: Path) -> None:
    """A step's job reads and writes its folder under PIPELINE_DIR: in a pod, on the claim the
    service mounts at the same path."""
    settings = env(EXECUTOR="kubernetes", K8S_IMAGE="trainer:1", NODES=NODES, K8S_PIPELINE_CLAIM="pipelines",
                   PIPELINE_DIR="/var/lib/opml/pipelines")
    api = FakeCoreV1Api()
    job = JobSpec(job_id="pl-q-1-fit", job_class=JobClass.TE, roles={"worker": RoleSpec(1, Resources(cpu_millis=100))})
    async with build_executor(settings, PLATFORM, kubernetes_api=api) as executor:
        await executor.launch(job, JobProgram(commands={"worker": ["python", "train.py"]}), {"worker": ("gpu-0",)},
                              attempt=0)
        pod = api.pods[pod_name("pl-q-1-fit", 0, "worker", 0)]
    assert {"name": "pipelines", "persistentVolumeClaim": {"claimName": "pipelines"}} in pod["spec"]["volumes"]
    assert {"name": "pipelines", "mountPath": "/var/lib/opml/pipelines"} in pod["spec"]["containers"][0]["volumeMounts"]
    api = FakeCoreV1Api()
    unset = env(EXECUTOR="kubernetes", K8S_IMAGE="trainer:1", NODES=NODES, K8S_PIPELINE_CLAIM="")
    async with build_executor(unset, PLATFORM, kubernetes_api=api) as executor:
        await executor.launch(job, JobProgram(commands={"worker": ["python", "train.py"]}), {"worker": ("gpu-0",)},
                              attempt=0)
        pod = api.pods[pod_name("pl-q-1-fit", 0, "worker", 0)]
    assert "pipelines" not in {v["name"] for v in pod["spec"]["volumes"]}


KUBECONFIG = """
apiVersion: v1
kind: Config
clusters: [{name: prod, cluster: {server: "https://k8s.example.com:6443"}}]
users: [{name: orchestrator, user: {token: not-a-real-token}}]
contexts: [{name: prod, context: {cluster: prod, user: orchestrator, namespace: ml}}]
current-context: prod
"""


async def test_without_an_api_the_kubernetes_executor_connects_at_start_from_the_kubeconfig(env,
                                                                                          tmp_path: Path) -> None:
    (tmp_path / "kubeconfig").write_text(KUBECONFIG)
    settings = env(EXECUTOR="kubernetes", K8S_IMAGE="trainer:1", NODES=NODES,
                   K8S_KUBECONFIG=str(tmp_path / "kubeconfig"), K8S_CONTEXT="prod")
    executor = build_executor(settings, PLATFORM)  # building it loads nothing
    assert executor._api is None
    await executor.start()  # loads the kubeconfig; no call reaches the server until a pod is created or listed
    assert executor._api.api_client.configuration.host == "https://k8s.example.com:6443"
    missing = build_executor(env(EXECUTOR="kubernetes", K8S_IMAGE="trainer:1", NODES=NODES,
                                 K8S_KUBECONFIG=str(tmp_path / "missing")), PLATFORM)
    with pytest.raises(FailedPrecondition, match="cannot configure the Kubernetes client from the kubeconfig"):
        await missing.start()
    in_cluster = build_executor(env(EXECUTOR="kubernetes", K8S_IMAGE="trainer:1", NODES=NODES, K8S_KUBECONFIG=""),
                                PLATFORM)
    with pytest.raises(FailedPrecondition, match="in-cluster service account"):  # no cluster here
        await in_cluster.start()


def test_platform_env_keeps_secrets_out_unless_asked() -> None:
    public = platform_env(PLATFORM)
    assert public["OPML_KAFKA_BOOTSTRAP"] == "kafka:9092" and public["OPML_KAFKA_IDEMPOTENCE"] == "false"
    assert "OPML_REDIS_URL" not in public and "OPML_S3_SECRET_KEY" not in public
    # Issue 16: what was asked with secrets=True (the platform's Redis URL) is never given to a job;
    # the job's own Redis user is.
    settings = JobOrchestratorSettings(job_redis_url="redis://job:jobpw@redis:6379/0")
    assert platform_env(PLATFORM, settings)["OPML_REDIS_URL"] == "redis://job:jobpw@redis:6379/0"
    assert "OPML_REDIS_URL" not in platform_env(PLATFORM, settings, credentials=False)
    assert "OPML_ENV" not in public and "OPML_AUTH_TOKENS" not in public


@pytest.mark.parametrize(("values", "error"), [
    ({"JOB_S3_ACCESS_KEY": "k"}, "must be set together"),
    ({"JOB_KAFKA_SASL_USERNAME": "job"}, "must be set together"),
])
def test_job_credentials_come_in_pairs(env, values: dict[str, str], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        env(**values)


def test_jobs_get_their_own_kafka_user_never_the_services(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("ca")
    platform = PlatformSettings(kafka_bootstrap="kafka:9093", kafka_security_protocol="SASL_SSL",
                                kafka_sasl_mechanism="SCRAM-SHA-512", kafka_sasl_username="job-orchestrator",
                                kafka_sasl_password="service-kafka-pw", kafka_ssl_cafile=str(tmp_path / "ca.pem"))
    settings = JobOrchestratorSettings(job_kafka_sasl_username="tracer", job_kafka_sasl_password="tracer-pw")
    env = platform_env(platform, settings)
    assert env["OPML_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL" and env["OPML_KAFKA_SSL_CAFILE"] == str(tmp_path / "ca.pem")
    assert (env["OPML_KAFKA_SASL_USERNAME"], env["OPML_KAFKA_SASL_PASSWORD"]) == ("tracer", "tracer-pw")
    assert "service-kafka-pw" not in env.values() and "job-orchestrator" not in env.values()
    assert "OPML_KAFKA_SASL_USERNAME" not in platform_env(platform)  # no job user set: none at all
