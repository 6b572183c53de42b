"""docs/security.md's table of roles is the code's: every RPC of every service, with the role it needs."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from opml_devstack.stack import installed_services
from opml_inference_router.kserve.roles import INFERENCE_METHOD_ROLES
from opml_job_orchestrator.pipelines.servicer import METHOD_ROLES as PIPELINE_METHOD_ROLES

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
KSERVE = "inference-router (KServe v2, router and workers)"
PIPELINES = "job-orchestrator (Pipelines)"


def _documented() -> dict[str, dict[str, str]]:
    roles: dict[str, dict[str, str]] = {}
    for service, role, rpcs in re.findall(r"^\| ([a-z-]+(?: \([^)]*\))?) \| (reader|inference|writer|admin) \| ([^|]+) \|$",
                                           DOC.read_text(), re.M):
        for rpc in rpcs.split(","):
            roles.setdefault(service, {})[rpc.strip()] = role
    return roles


def test_the_roles_table_is_every_rpc_with_its_role() -> None:
    expected = {spec.name: dict(importlib.import_module(f"{spec.module}.servicer").METHOD_ROLES)
                for spec in installed_services()}
    expected[KSERVE] = dict(INFERENCE_METHOD_ROLES)
    expected[PIPELINES] = dict(PIPELINE_METHOD_ROLES)  # the job-orchestrator's second gRPC service
    assert _documented() == expected
