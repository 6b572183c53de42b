"""Every deployed service with a bundle-store target setting is given the bundle-store's address and a
token, in compose and on Kubernetes: left unset, a producer commits nothing and no one is told."""

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
