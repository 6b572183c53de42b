"""Deployment manifests are valid without a cluster: Kubernetes objects against the API schema."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_kubernetes_manifests_match_the_api_schema(manifest: Path) -> None:
    documents = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
    assert documents
    for document in documents:
        kubernetes_validate.validate(document, "1.37.0", strict=True)


def test_compose_runs_every_kubernetes_service() -> None:
    compose = yaml.safe_load((ROOT / "deploy" / "compose" / "docker-compose.yml").read_text())
    deployed = {d["metadata"]["name"] for m in MANIFESTS for d in yaml.safe_load_all(m.read_text())
                if d and d["kind"] == "Deployment"}
    assert deployed and deployed <= set(compose["services"])
