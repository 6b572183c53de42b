"""Every deployed service with a bundle-store target setting is given the bundle-store's address and a
token, in compose and on Kubernetes: left unset, a producer commits nothing and no one is told."""

import json
from pathlib import Path

import yaml

from opml_devstack.stack import installed_services

ROOT = Path(__file__).resolve().parents[2]
STORE = "bundle-store:50051"


def _bundle_users() -> dict[str, str]:
    """Service name -> its settings' env prefix, for every service that reads or commits bundles."""
    users = {spec.name: spec.env_prefix for spec in installed_services()
             if "bundle_store_target" in spec.settings.model_fields}
    assert {"automl-controller", "fl-coordinator", "inference-router", "monitoring-scorer"} <= set(users)
    return users


def _target_and_token(env: dict, prefix: str) -> tuple[object, object]:
    target = env.get(f"{prefix}BUNDLE_STORE_TARGET", env.get("OPML_BUNDLE_STORE_TARGET"))
    return target, env.get(f"{prefix}BUNDLE_STORE_TOKEN")


def test_compose_gives_every_bundle_user_the_bundle_store() -> None:
    compose = yaml.safe_load((ROOT / "deploy" / "compose" / "docker-compose.yml").read_text())
    wrong = {}
    for name, prefix in _bundle_users().items():
        service = compose["services"][name]
        target, token = _target_and_token(service["environment"], prefix)
        if target != STORE or not token or "bundle-store" not in service["depends_on"]:
            wrong[name] = (target, bool(token), sorted(service["depends_on"]))
    assert not wrong, f"compose services without the bundle-store (target, token, depends_on): {wrong}"


def test_kubernetes_gives_every_bundle_user_the_bundle_store() -> None:
    documents = [d for m in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(m.read_text())
                 if d]
    deployments = {d["metadata"]["name"]: d for d in documents if d["kind"] in ("Deployment", "StatefulSet")}
    wrong = {}
    for name, prefix in _bundle_users().items():
        (container,) = deployments[name]["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
        target, token = _target_and_token(env, prefix)
        if target != STORE or not token:
            wrong[name] = (target, bool(token))
    assert not wrong, f"Deployments without the bundle-store (target, token): {wrong}"


def test_the_bundle_store_runs_replicas_that_share_every_context_the_platform_uses() -> None:
    """Several replicas only when every context a service uses is shared through S3 (a local-only one lives
    in one replica's home), each replica with its own home (one process per home)."""
    documents = [d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "bundle-store.yaml").read_text()) if d]
    (workload,) = [d for d in documents if d["kind"] in ("Deployment", "StatefulSet")]
    assert workload["kind"] == "StatefulSet" and workload["spec"]["replicas"] >= 2
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    shared = json.loads(env["OPML_BUNDLE_STORE_SHARED_CONTEXTS"])
    assert shared and all(url.startswith("s3://") for url in shared.values())

    documents_all = [d for m in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(m.read_text())
                     if d]
    workloads = {d["metadata"]["name"]: d for d in documents_all if d["kind"] in ("Deployment", "StatefulSet")}
    used = {}
    for spec in installed_services():
        for field_name, field in spec.settings.model_fields.items():
            if not field_name.endswith("context") or "bundle-store" not in (field.description or ""):
                continue
            (user,) = workloads[spec.name]["spec"]["template"]["spec"]["containers"]
            user_env = {e["name"]: e.get("value") for e in user["env"]}
            used[spec.name] = user_env.get(f"{spec.env_prefix}{field_name.upper()}", field.default)
    assert {"automl-controller", "fl-coordinator"} <= set(used)
    assert not {name: context for name, context in used.items() if context not in shared}, "contexts not shared"

    home = env["OPML_BUNDLE_STORE_HOME"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == home]
    templates = {t["metadata"]["name"]: t for t in workload["spec"]["volumeClaimTemplates"]}
    assert mount["name"] in templates, "a home is one process's: each replica needs its own claim"
    assert templates[mount["name"]]["spec"]["accessModes"] == ["ReadWriteOnce"]
