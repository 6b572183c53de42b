"""Every service follows docs/adding-a-service.md: the items marked (checked) there, for each services/*.

A new service that misses one fails here with the item named, before a reviewer has to notice.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from opml_common.grpc.client import ServiceClient
from opml_common.process import ServiceSpec
from opml_common.topics import Topic

ROOT = Path(__file__).resolve().parents[2]
SERVICES = sorted(p.parent for p in (ROOT / "services").glob("*/pyproject.toml"))
GRPC_IMPORT = re.compile(r"^\s*(import grpc\b|from grpc\b|from grpc\.|import grpc\.|from [\w.]+ import \w+_pb2_grpc)", re.M)

# Modules of a service that are transport, besides its servicers, client, CLI and __main__; each says why.
TRANSPORT_MODULES = {
    "inference-router": {
        "frontend.py": "the KServe v2 servicer of the router",
        "control/workers.py": "asks each worker process for its health over gRPC",
        "routing/grpc_replica.py": "the gRPC replica: one of the router's transports to a worker",
        "frames.py": "the frame protocol of the workers' Unix sockets and the native front's link (gRPC status codes)",
        "hosts/service.py": "the router's HostService servicer: host agents register, heartbeat, forward predictions",
        "hosts/remote.py": "the router's calls to a host's agent (bundles, link probes) and its workers",
        "hosts/forwarding.py": "a host agent forwards the predictions of its outbox to the router",
        "hosts/agent.py": "the host agent process: registers and heartbeats, serves bundles and KServe v2",
        "leader_calls.py": "a follower replica forwards control-plane calls to the leader's gRPC address",
        "control/scorer_windows.py": "reads a version's windows back from the monitoring-scorer's API (grpc.aio)",
    },
}


def _package(service: Path) -> Path:
    (package,) = [p for p in (service / "src").iterdir() if p.is_dir() and p.name.startswith("opml_")
                  and not p.name.endswith(".egg-info")]
    return package


def _spec(service: Path) -> ServiceSpec:
    return importlib.import_module(f"{_package(service).name}.__main__").SPEC


@pytest.fixture(params=SERVICES, ids=lambda p: p.name)
def service(request: pytest.FixtureRequest) -> Path:
    return request.param


def test_the_package_publishes_the_service_and_its_cli(service: Path) -> None:
    project = tomllib.loads((service / "pyproject.toml").read_text())["project"]
    package = _package(service).name
    assert project["name"] == f"opml-{service.name}"
    assert project["entry-points"]["opml.services"] == {service.name: f"{package}.__main__"}
    groups = project["entry-points"]["opml.cli"].values()  # `opml <noun>`: one or more per service
    assert groups and all(cli.startswith(f"{package}.") and cli.partition(":")[0].endswith(".cli") for cli in groups)
    assert "test" in project["optional-dependencies"]
    assert list((service / "tests").glob("test_*.py")), "unit and service tests live next to the service"


def test_main_is_wiring_only(service: Path) -> None:
    module = importlib.import_module(f"{_package(service).name}.__main__")
    assert isinstance(module.SPEC, ServiceSpec) and module.SPEC.name == service.name
    assert inspect.iscoroutinefunction(module.build)
    source = inspect.getsource(module)
    assert "run_service(SPEC, build)" in source
    tree = ast.parse(source)
    hand_ordered = [node.lineno for node in ast.walk(tree)
                    if isinstance(node, ast.Try) and node.finalbody or isinstance(node, ast.AsyncWith)]
    assert not hand_ordered, f"start/stop order belongs to run_service, not __main__ (lines {hand_ordered})"


def test_settings_have_the_service_prefix_and_ports_of_their_own() -> None:
    ports: dict[int, str] = {}
    for service in SERVICES:
        settings = _spec(service).settings
        assert settings.model_config["env_prefix"] == "OPML_" + service.name.upper().replace("-", "_") + "_"
        for field in ("grpc_port", "metrics_port"):
            port = settings.model_fields[field].default
            assert port not in ports, f"{service.name}.{field} = {port} is {ports.get(port)}'s already"
            ports[port] = f"{service.name}.{field}"


def _contract(service: Path) -> str:
    """The module of the service's contract package (services/<name>/contract)."""
    return f"{_package(service).name}_contract"


def test_topics_come_from_the_events_protos(service: Path) -> None:
    published = importlib.import_module(f"{_contract(service)}.topics")
    topics = {value for value in vars(published).values() if isinstance(value, Topic)}
    assert topics, "the contract's topics.py names the topics the service publishes"
    if (_package(service) / "topics.py").exists():  # what it consumes, from the owners' contracts
        consumed = importlib.import_module(f"{_package(service).name}.topics")
        topics |= {value for value in vars(consumed).values() if isinstance(value, Topic)}
    assert set(_spec(service).topics) == topics, "SPEC.topics (created at start-up) are the topics.py files'"


def test_the_servicer_names_every_role_and_publishes_nothing(service: Path) -> None:
    package = _package(service)
    servicer = importlib.import_module(f"{package.name}.servicer")
    assert isinstance(servicer.METHOD_ROLES, dict) and servicer.METHOD_ROLES
    source = (package / "servicer.py").read_text()
    for banned in ("CloudEvent", "Outbox", "EventPublisher", ".emit(", "publish("):
        assert banned not in source, f"servicer.py uses {banned}: events come from the core"
    assert list(package.rglob("convert.py")), "conversions between the core and protobuf live in convert.py"


def test_the_core_imports_no_grpc(service: Path) -> None:
    package = _package(service)
    allowed = set(TRANSPORT_MODULES.get(service.name, {}))
    edge = {"__main__.py", "servicer.py", "cli.py", "testing.py"}  # testing: fakes for other suites
    offenders = [str(path.relative_to(package)) for path in package.rglob("*.py")
                 if path.name not in edge and str(path.relative_to(package)) not in allowed
                 and GRPC_IMPORT.search(path.read_text())]
    assert not offenders, f"core modules import grpc (move the transport to the servicer or list it): {offenders}"


def test_client_and_cli_are_built_on_the_template(service: Path) -> None:
    client = importlib.import_module(f"{_contract(service)}.client")
    assert any(inspect.isclass(value) and issubclass(value, ServiceClient) and value is not ServiceClient
               for value in vars(client).values()), "the contract's client.py holds a ServiceClient subclass"
    cli = (_package(service) / "cli.py").read_text()
    assert "@service_group(" in cli and "class _Session" not in cli


def test_readme_documents_every_rpc_and_event(service: Path) -> None:
    readme = (service / "README.md").read_text()
    servicer = importlib.import_module(f"{_package(service).name}.servicer")
    missing = [rpc for rpc in servicer.METHOD_ROLES if rpc not in readme]
    assert not missing, f"{service.name}/README.md does not document {missing}"
    missing = [t.name for t in _spec(service).topics if t.name not in readme]
    assert not missing, f"{service.name}/README.md does not name the topics it uses: {missing}"


def test_dashboard_scrape_compose_and_kubernetes_know_the_service(service: Path) -> None:
    spec = _spec(service)
    dashboard = ROOT / "deploy" / "compose" / "grafana" / "dashboards" / f"opml-{service.name}.json"
    assert json.loads(dashboard.read_text())["uid"] == f"opml-{service.name}"
    metrics_port = spec.settings.model_fields["metrics_port"].default
    assert f"{service.name}:{metrics_port}" in (ROOT / "deploy" / "compose" / "prometheus.yml").read_text()
    compose = yaml.safe_load((ROOT / "deploy" / "compose" / "docker-compose.yml").read_text())
    assert service.name in compose["services"]
    manifest = [d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / f"{service.name}.yaml").read_text()) if d]
    kinds = {d["kind"] for d in manifest}
    assert "Service" in kinds and kinds & {"Deployment", "StatefulSet"}
    (deployment,) = [d for d in manifest if d["kind"] in ("Deployment", "StatefulSet")]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(metrics_port)
    assert service.name in (ROOT / "README.md").read_text()
