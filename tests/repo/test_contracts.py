"""Services depend on each other's contracts, never on each other's packages.

Each service publishes a thin contract package at services/<name>/contract (its client, resource
names, the topics it publishes, its event source, and what other services need to write its
requests) that depends on protos and libs/common only. A service that imported another's package
would install that service's whole dependency tree (the router brings onnxruntime, the tracer's
tests TensorFlow) and couple to its internals; these checks fail with the offending import named.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
SERVICES = sorted(p.parent for p in (ROOT / "services").glob("*/pyproject.toml"))
SERVICE_MODULES = {f"opml_{s.name.replace('-', '_')}": s.name for s in SERVICES}
# A contract's own dependencies besides opml-common and opml-protos, each with why.
CONTRACT_THIRD_PARTY = {
    "PyYAML": "the job spec is YAML (job-orchestrator)",
    "numpy": "federated weights are arrays (fl-coordinator); a reference set is arrays (monitoring-scorer)",
}


@pytest.fixture(params=SERVICES, ids=lambda p: p.name)
def service(request: pytest.FixtureRequest) -> Path:
    return request.param


def _module(service: Path) -> str:
    return f"opml_{service.name.replace('-', '_')}"


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports (absolute imports; the lazy ones inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _service_package_imported(module: str) -> str | None:
    """The service whose *package* (not contract) ``module`` is, if any."""
    return SERVICE_MODULES.get(module.split(".")[0])


def test_no_service_imports_another_services_package(service: Path) -> None:
    own = _module(service)
    offenders = [f"{path.relative_to(ROOT)}:{line}: {module}"
                 for path in sorted((service / "src").rglob("*.py"))
                 for line, module in _imports(path)
                 if _service_package_imported(module) not in (None, service.name) and module.split(".")[0] != own]
    assert not offenders, "import another service through its contract (opml_<service>_contract):\n" + "\n".join(
        offenders)


def test_the_contract_is_thin(service: Path) -> None:
    contract = service / "contract"
    project = tomllib.loads((contract / "pyproject.toml").read_text())["project"]
    assert project["name"] == f"opml-{service.name}-contract"
    names = {Requirement(r).name for r in project["dependencies"]}
    allowed = {"opml-common", "opml-protos", *CONTRACT_THIRD_PARTY}
    assert names <= allowed, f"a contract depends on protos and libs/common only, not {sorted(names - allowed)}"
    offenders = [f"{path.relative_to(ROOT)}:{line}: {module}"
                 for path in sorted((contract / "src").rglob("*.py"))
                 for line, module in _imports(path) if _service_package_imported(module)]
    assert not offenders, "a contract imports no service package:\n" + "\n".join(offenders)


def test_a_service_depends_on_other_services_through_their_contracts_only(service: Path) -> None:
    project = tomllib.loads((service / "pyproject.toml").read_text())["project"]
    names = {Requirement(r).name for r in project["dependencies"]}
    packages = {f"opml-{s.name}" for s in SERVICES}
    assert not names & packages, f"depend on the contract (opml-<service>-contract), not {sorted(names & packages)}"
    assert f"opml-{service.name}-contract" in names, "a service depends on its own contract"


def test_the_event_source_is_the_contracts(service: Path) -> None:
    spec = importlib.import_module(f"{_module(service)}.__main__").SPEC
    names = importlib.import_module(f"{_module(service)}_contract.names")
    assert (spec.name, spec.event_source) == (names.SERVICE, names.EVENT_SOURCE)


def test_no_copy_of_an_event_source() -> None:
    """A consumer filtering on another service's source names that contract's EVENT_SOURCE."""
    alternatives = "|".join(re.escape(s.name) for s in SERVICES)
    pattern = re.compile(rf"""["']opml/({alternatives})["']""")
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                 for service in SERVICES for path in sorted((service / "src").rglob("*.py"))
                 for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, "use the owner's contract names.EVENT_SOURCE:\n" + "\n".join(offenders)


def test_names_and_topics_import_no_transport(service: Path) -> None:
    """A transport-free core or a traced job imports a contract's names and topics without its client's
    grpc or the settings' pydantic; every exported name still resolves."""
    contract = f"{_module(service)}_contract"
    code = (f"import sys, {contract} as c, {contract}.names, {contract}.topics\n"
            "heavy = sorted(m for m in ('grpc', 'pydantic', 'sklearn', 'opml_common.config') if m in sys.modules)\n"
            "assert not heavy, heavy\n"
            "assert all(getattr(c, name) is not None for name in c.__all__)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _production_closure(name: str) -> set[str]:
    """Every distribution installing ``name`` brings, extras left out (as `pip install name` would)."""
    seen: set[str] = set()
    pending = [name]
    while pending:
        current = pending.pop()
        key = current.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = distribution(current).requires or []
        except PackageNotFoundError:
            continue
        for text in requires:
            requirement = Requirement(text)
            if requirement.marker is not None and "extra" in str(requirement.marker):
                continue
            if requirement.marker is None or requirement.marker.evaluate():
                pending.append(requirement.name)
    return seen


def test_installing_the_automl_controller_brings_no_onnxruntime_tensorflow_or_torch() -> None:
    closure = _production_closure("opml-automl-controller")
    assert "opml-job-orchestrator-contract" in closure  # the walk follows the real metadata
    heavy = {"onnxruntime", "tensorflow", "tensorflow-cpu", "torch", "opml-inference-router",
             "opml-job-orchestrator", "opml-bundle-store", "opml-trace-collector"}
    assert not closure & heavy, sorted(closure & heavy)
