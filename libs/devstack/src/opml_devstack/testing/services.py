"""Platform services as real processes in tests (the ``start_service`` fixture of the opml_infra plugin).

Each process gets the test's infrastructure and prefixes (``settings_env``), free gRPC and metrics
ports, its own home directory and log under the test's ``tmp_path``, and auth on with the tokens in
:data:`TOKENS`; every process made is stopped when the test ends, failed or not.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import entry_points
from pathlib import Path

from opml_common.process import ExitedBeforeServing, ServiceSpec
from opml_devstack.devinfra import free_port, release_ports
from opml_devstack.process import ServiceProcess

TOKENS = {"admin": "admin-token", "writer": "writer-token", "reader": "reader-token"}
"""Bearer token of each role the started services accept (``OPML_AUTH_TOKENS``)."""

PORT_ATTEMPTS = 3
"""Starts with fresh ports before a process whose port was taken fails its test."""


def service_spec(service: str | ServiceSpec) -> ServiceSpec:
    """The spec of an installed service, by its ``opml.services`` entry-point name (``"bundle-store"``)."""
    if isinstance(service, ServiceSpec):
        return service
    found = entry_points(group="opml.services", name=service)
    if not found:
        names = sorted(entry.name for entry in entry_points(group="opml.services"))
        raise ValueError(f"`service` must be an installed service, one of {names}, but got {service!r}")
    return next(iter(found)).load().SPEC


def env_prefix(spec: ServiceSpec) -> str:
    """The service's settings prefix, e.g. ``OPML_BUNDLE_STORE_``."""
    return spec.env_prefix


class ServiceStarter:
    """Makes service processes for one test and stops them all at its end (:meth:`stop_all`).

    Call it to start one: ``start_service("bundle-store", extra_env={...})``. Use :meth:`env` first
    where a test needs the environment before (or without) a process, e.g. to run a second process
    of the service on the same ports and home after a restart.
    """

    def __init__(self, settings_env: Mapping[str, str], tmp_path: Path) -> None:
        self._settings_env = dict(settings_env)
        self._tmp_path = tmp_path
        self._made: list[ServiceProcess] = []
        self._names: dict[str, int] = {}
        self._ports: list[int] = []

    def env(self, service: str | ServiceSpec, *, tokens: Mapping[str, str] | None = TOKENS,
            extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of one process of ``service``: the test's ``settings_env``, fresh free ports,
        a home directory of its own (for services that have one), ``tokens`` (None: auth off), then
        ``extra_env``, which overrides all of these."""
        spec = service_spec(service)
        prefix = env_prefix(spec)
        env = {**self._settings_env, f"{prefix}GRPC_PORT": str(self._port()), f"{prefix}METRICS_PORT": str(self._port()),
               **{f"{prefix}{name.upper()}_PORT": str(self._port()) for name in spec.extra_ports()}}
        if "home" in spec.settings.model_fields:
            env[f"{prefix}HOME"] = str(self._tmp_path / self._unique(f"{spec.name}-home"))
        if tokens is not None:
            env["OPML_AUTH_TOKENS"] = ",".join(f"{token}={role}" for role, token in tokens.items())
        return {**env, **(extra_env or {})}

    def __call__(self, service: str | ServiceSpec, *, env: Mapping[str, str] | None = None,
                 tokens: Mapping[str, str] | None = TOKENS, extra_env: Mapping[str, str] | None = None,
                 start: bool = True) -> ServiceProcess:
        """A process of ``service`` (started unless ``start`` is False), stopped at the end of the test.

        ``env`` is a whole environment as :meth:`env` makes it (its ports included: a restart reuses
        one), else a fresh one is made with ``tokens``; ``extra_env`` overrides either. Output goes to
        ``<tmp_path>/<name>.log``. A process made with fresh ports that ends because one was taken
        meanwhile (another test's process bound it first) is made again on new ones.
        """
        spec = service_spec(service)
        fresh_ports, attempts = env is None, 1
        while True:
            made = {**(self.env(spec, tokens=tokens) if fresh_ports else env), **(extra_env or {})}
            process = ServiceProcess(spec.module, int(made[f"{env_prefix(spec)}GRPC_PORT"]), made,
                                     self._tmp_path / f"{self._unique(spec.name)}.log")
            self._made.append(process)
            if not start:
                return process
            try:
                return process.start()
            except ExitedBeforeServing as exited:
                # A free port picked here can be taken by another test's process before ours binds it.
                if not (fresh_ports and exited.port_taken and attempts < PORT_ATTEMPTS):
                    raise
                attempts += 1

    def stop_all(self) -> None:
        """Stop every process made, the last made first (a client service before what it calls), then
        release the ports picked for them."""
        for process in reversed(self._made):
            process.stop()
        release_ports(self._ports)
        self._ports.clear()

    def _port(self) -> int:
        """A free port, held until :meth:`stop_all` (a restart in the test finds it still free)."""
        self._ports.append(free_port())
        return self._ports[-1]

    def _unique(self, name: str) -> str:
        """``name`` the first time, then ``name-2``, ``name-3``…: two processes never share a file."""
        self._names[name] = self._names.get(name, 0) + 1
        return name if self._names[name] == 1 else f"{name}-{self._names[name]}"
