"""A port picked free can be taken by another process before a service binds it (two pytest workers
start services at once): the service must fail to bind rather than share the port, readiness must
be the started process's own, and the test's service starter picks new ports and starts again.

Real processes and real gRPC servers; only the port the starter picks first is chosen by the test.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from pydantic_settings import SettingsConfigDict

from opml_common.config import PlatformSettings, ServiceSettings
from opml_common.grpc.server import GrpcServer
from opml_common.metrics import ServiceMetrics
from opml_common.process import ExitedBeforeServing, ServiceSpec, listens_on, wait_until_serving
from opml_devstack.devinfra import free_port, release_ports
from opml_devstack.testing import services

# A service of nothing but the template: health, reflection and metrics on the ports its env gives.
SERVICE_MAIN = """
import asyncio
from prometheus_client import CollectorRegistry
from opml_common.config import PlatformSettings, ServiceSettings
from opml_common.grpc.server import GrpcServer
from opml_common.metrics import ServiceMetrics
from pydantic_settings import SettingsConfigDict


class PortTestSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="OPML_PORT_TEST_")


async def main():
    async with GrpcServer(settings=PortTestSettings(), platform=PlatformSettings(),
                          metrics=ServiceMetrics("port-test", CollectorRegistry()), registrations=[]):
        await asyncio.Event().wait()

asyncio.run(main())
"""


class PortTestSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="OPML_PORT_TEST_")


def _server(port: int = 0) -> GrpcServer:
    return GrpcServer(settings=ServiceSettings(grpc_port=port, metrics_port=0), platform=PlatformSettings(),
                      metrics=ServiceMetrics("port-test", CollectorRegistry()), registrations=[])


def _health_checks(server: GrpcServer) -> float:
    return server.metrics.registry.get_sample_value(
        "opml_port_test_grpc_requests_total", {"method": "Check", "code": "OK"}) or 0


async def test_a_server_on_a_port_another_server_listens_on_fails_to_bind() -> None:
    async with _server() as first:
        second = _server(first.port)
        with pytest.raises(RuntimeError, match="(?i)failed to bind"):
            await second.start()


async def test_a_picked_port_is_held_for_its_server_until_released() -> None:
    """free_port() keeps the port from everyone but a server binding it as servers do (SO_REUSEADDR),
    here the platform's gRPC server (so_reuseport off), until release_ports."""
    port = free_port()
    with socket.socket() as plain, pytest.raises(OSError, match="in use"):
        plain.bind(("127.0.0.1", port))
    async with _server(port) as server:
        assert server.port == port and listens_on(os.getpid(), port) is True
    release_ports([port])
    with socket.socket() as plain:
        plain.bind(("127.0.0.1", port))


def test_make_ups_fixed_ports_are_never_picked_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """The services' gRPC ports (50051-50057) lie in the kernel's range of free ports: a test holding one
    (the trace-collector's 50054 once) kept a running `make up`'s service from binding it. Here the kernel
    offers one of `make up`'s ports first (a port it offered a moment ago, standing for 50054)."""
    from opml_common import ports
    from opml_devstack import devinfra

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        stacks = probe.getsockname()[1]
    offers = iter([stacks])
    monkeypatch.setattr(devinfra, "STACK_PORTS", frozenset({stacks}))
    monkeypatch.setattr(devinfra, "hold_free_port", lambda: _bound(next(offers, None)) or ports.hold_free_port())

    port = free_port()
    try:
        assert port != stacks
        with socket.socket() as later:  # the stack's port is not kept from the stack either
            later.bind(("127.0.0.1", stacks))
    finally:
        release_ports([port])


def test_the_stack_ports_free_port_avoids_are_make_ups() -> None:
    from opml_devstack.devinfra import STACK_PORTS
    from opml_devstack.stack import StackConfig, loadable_services

    defaults = StackConfig()
    assert {defaults.kafka_port, defaults.s3_port, defaults.prometheus_port, 6379} <= STACK_PORTS
    for spec in loadable_services()[0]:
        named = {name: field.default for name, field in spec.settings.model_fields.items() if name.endswith("_port")}
        assert set(named.values()) <= STACK_PORTS, f"{spec.name}: {named}"


def _bound(port: int | None) -> socket.socket | None:
    if port is None:
        return None
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


def test_listens_on_tells_which_process_holds_the_port() -> None:
    listener = subprocess.Popen(
        [sys.executable, "-c", "import socket, sys\n"
         "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
         "print(s.getsockname()[1], flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(listener.stdout.readline())
        assert listens_on(listener.pid, port) is True
        assert listens_on(os.getpid(), port) is False
    finally:
        listener.stdin.close()
        listener.wait()


async def test_readiness_is_not_taken_from_another_process_serving_on_the_port() -> None:
    """A process that never listens, while another server answers health on its port: readiness waits
    for it (and fails when it ends) instead of taking the other server's SERVING for its own."""
    silent = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read(); sys.exit(3)"],
                              stdin=subprocess.PIPE)
    async with _server() as other:
        waiting = asyncio.create_task(asyncio.to_thread(
            wait_until_serving, f"127.0.0.1:{other.port}", timeout_s=120, process=silent))
        while _health_checks(other) < 1 and not waiting.done():  # it has had the other server's answer
            await asyncio.sleep(0.01)
        silent.stdin.close()
        with pytest.raises(ExitedBeforeServing) as exited:
            await waiting
    assert silent.wait() == 3 and not exited.value.port_taken


def test_the_starter_starts_again_on_new_ports_when_a_picked_port_was_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "port_test_service.py").write_text(SERVICE_MAIN)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'pkg'}")
    spec = ServiceSpec("port-test", "port_test_service", PortTestSettings)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        picks = iter([taken.getsockname()[1]])
        monkeypatch.setattr(services, "free_port", lambda: next(picks, None) or free_port())
        starter = services.ServiceStarter({}, tmp_path)
        try:
            started = starter(spec, tokens=None)
            assert listens_on(started.process.pid, started.grpc_port) is True
            assert started.grpc_port != taken.getsockname()[1]
            first_log = (tmp_path / "port-test.log").read_text()
            assert "failed to bind" in first_log.lower()
        finally:
            starter.stop_all()

