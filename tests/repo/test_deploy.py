"""Deployment manifests are valid without a cluster: Kubernetes objects against the API schema."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
WORKLOADS = ("Deployment", "StatefulSet")


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_kubernetes_manifests_match_the_api_schema(manifest: Path) -> None:
    documents = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
    assert documents
    for document in documents:
        kubernetes_validate.validate(document, "1.37.0", strict=True)


def test_compose_runs_every_kubernetes_service() -> None:
    compose = yaml.safe_load((ROOT / "deploy" / "compose" / "docker-compose.yml").read_text())
    deployed = {d["metadata"]["name"] for m in MANIFESTS for d in yaml.safe_load_all(m.read_text())
                if d and d["kind"] in WORKLOADS}
    assert deployed and deployed <= set(compose["services"])


# -- Kafka security: every service authenticates with SASL, and only a topic's owner may write it ----------

COMPOSE = ROOT / "deploy" / "compose" / "docker-compose.yml"
KAFKA_INIT = ROOT / "deploy" / "compose" / "kafka-init.sh"
# Who alone may write each topic (docs/security.md); the tracers inside jobs publish as `tracer`.
TOPIC_WRITERS = {"opml.bundles.v1": "bundle-store", "opml.jobs.v1": "job-orchestrator",
                 "opml.pipelines.v1": "job-orchestrator",
                 "opml.predictions.v1": "inference-router", "opml.deployments.v1": "inference-router",
                 "opml.traces.v1": "tracer", "opml.federations.v1": "fl-coordinator",
                 "opml.alerts.v1": "monitoring-scorer", "opml.quality.v1": "monitoring-scorer",
                 "opml.labels.v1": "monitoring-scorer",
                 "opml.experiments.v1": "automl-controller"}


def _platform_services(compose: dict) -> dict[str, dict]:
    return {name: service for name, service in compose["services"].items()
            if service.get("build", {}).get("dockerfile") == "deploy/Dockerfile"}


def _substituted(value: str) -> str:
    """A compose value with ``${VAR:?...}``/``${VAR:-default}`` replaced as `docker compose` would with .env set."""
    import re

    return re.sub(r"\$\{(\w+)(?::[?-][^}]*)?\}", lambda m: f"test-{m.group(1).lower()}", str(value))


def test_every_compose_service_authenticates_to_kafka_with_its_own_sasl_user() -> None:
    from opml_common.config import PlatformSettings
    from opml_devstack.stack import installed_services

    compose = yaml.safe_load(COMPOSE.read_text())
    services = _platform_services(compose)
    assert set(services) == {spec.name for spec in installed_services()}  # every service, none forgotten
    for name, service in services.items():
        env = service["environment"]
        assert env["OPML_KAFKA_SECURITY_PROTOCOL"].startswith("SASL_"), name
        assert env["OPML_KAFKA_SASL_USERNAME"] == name
        assert env["OPML_KAFKA_SASL_PASSWORD"].startswith("${KAFKA_") and ":?" in env["OPML_KAFKA_SASL_PASSWORD"]
        assert service["depends_on"]["kafka-init"] == {"condition": "service_completed_successfully"}, name
        # The settings as the service reads them pass validation (OPML_ENV=prod refuses PLAINTEXT).
        values = {key[len("OPML_"):].lower(): _substituted(value) for key, value in env.items()
                  if key.startswith("OPML_") and key[len("OPML_"):].lower() in PlatformSettings.model_fields}
        settings = PlatformSettings(**{**values, "auth_tokens": "compose-test=admin"})
        assert settings.env == "prod" and settings.kafka_sasl_username == name
    passwords = {services[name]["environment"]["OPML_KAFKA_SASL_PASSWORD"] for name in services}
    assert len(passwords) == len(services)  # one credential per service, never shared
    kafka = compose["services"]["kafka"]["environment"]
    assert all(listener.startswith(("SASL_PLAINTEXT://", "SASL_SSL://", "CONTROLLER://"))
               for listener in kafka["KAFKA_LISTENERS"].split(","))
    assert kafka["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false" and "StandardAuthorizer" in kafka[
        "KAFKA_AUTHORIZER_CLASS_NAME"]
    assert "9093" not in str(compose["services"]["kafka"].get("ports", ""))  # the controller listener stays inside


def test_kafka_init_lets_only_the_owner_write_each_topic() -> None:
    import shlex

    writers: dict[str, set[str]] = {}
    users: set[str] = set()
    for line in KAFKA_INIT.read_text().splitlines():
        if not line.startswith(("user ", "owns ", "acl ", "reads ")):
            continue  # only the script's top-level calls of its helpers
        words = shlex.split(line, comments=True)
        if words[0] == "user":
            users.add(words[1])
        elif words[0] == "owns":
            writers.setdefault(words[2], set()).add(words[1])
        elif words[0] == "acl" and "Write" in words and "--topic" in words:
            writers.setdefault(words[words.index("--topic") + 1], set()).add(words[1])
    topics = {topic: who for topic, who in writers.items() if not topic.endswith(".dlq")}
    assert topics == {topic: {owner} for topic, owner in TOPIC_WRITERS.items()}
    assert set(TOPIC_WRITERS.values()) <= users


def test_every_kubernetes_service_gets_its_kafka_sasl_user_from_a_secret() -> None:
    documents = [d for m in MANIFESTS for d in yaml.safe_load_all(m.read_text()) if d]
    platform = next(d for d in documents if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "opml-platform")
    assert platform["data"]["OPML_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
    cafile = Path(platform["data"]["OPML_KAFKA_SSL_CAFILE"])
    deployments = [d for d in documents if d["kind"] in WORKLOADS]
    assert deployments
    for deployment in deployments:
        name = deployment["metadata"]["name"]
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["OPML_KAFKA_SASL_USERNAME"]["value"] == name
        assert env["OPML_KAFKA_SASL_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "opml-kafka", "key": name}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert Path(mounts["kafka-ca"]) == cafile.parent, name
        assert volumes["kafka-ca"]["secret"]["secretName"] == "opml-kafka-ca"
