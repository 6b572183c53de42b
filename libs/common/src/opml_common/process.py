"""How a service is run (:class:`ServiceSpec`, each service's ``opml.services`` entry point) and the
process helpers production code shares: wait until a started process serves, stop one gracefully.
Running a service as a child process for the dev stack and tests is :mod:`opml_devstack.process`."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``), for a
    helper process a service spawns (a ``ProcessPoolExecutor``'s ``initializer``): a SIGKILLed service
    gets no chance to stop its children, and a pool worker blocked on its task queue outlives it for
    good otherwise. A no-op where prctl is missing (not Linux)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def terminate(process: subprocess.Popen, *, timeout_s: float) -> None:
    """SIGTERM (a graceful stop), then SIGKILL if the process is still there after ``timeout_s``."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class ExitedBeforeServing(RuntimeError):
    """The service process ended before it served; ``log_tail`` is the end of its output."""

    def __init__(self, returncode: int, log_tail: str) -> None:
        super().__init__(f"service exited with {returncode} before serving:\n{log_tail}")
        self.log_tail = log_tail

    @property
    def port_taken(self) -> bool:
        """Whether it ended because one of its ports was taken (by gRPC's or the metrics server's bind)."""
        tail = self.log_tail.lower()
        return "address already in use" in tail or "failed to bind" in tail


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds a TCP socket listening on ``port`` (None where /proc cannot tell).

    A health answer on a port says that *some* server is there; this says it is the one just started,
    not another that took the port first."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return None
    for fd in fds:
        try:
            if os.readlink(fd) in inodes:
                return True
        except OSError:
            continue
    return False


def wait_until_serving(target: str, *, timeout_s: float, process: subprocess.Popen | None = None,
                       log_path: Path | None = None, env: Mapping[str, str] | None = None) -> None:
    """Block until the gRPC health service at ``target`` answers SERVING, and, given ``process``, that
    process is the one listening there. The channel is secured as ``OPML_GRPC_TLS_*`` in ``env`` says
    (default: this process's environment). Raises :class:`ExitedBeforeServing` if ``process`` ends."""
    from opml_common.grpc.client import open_channel, tls_settings

    port = int(target.rsplit(":", 1)[1])
    deadline = time.monotonic() + timeout_s
    with open_channel(target, tls=tls_settings(env)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                tail = log_path.read_text()[-3000:] if log_path and log_path.exists() else ""
                raise ExitedBeforeServing(process.returncode, tail)
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING and (
                        process is None or listens_on(process.pid, port) is not False):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{target} did not report SERVING within {timeout_s}s")


@dataclass(frozen=True)
class ServiceSpec:
    """How to run one service: published by each service under the ``opml.services`` entry points."""

    name: str
    module: str
    settings: type  # the service's ServiceSettings subclass (gives its ports)
    # Settings of the service's other processes (a tracer inside user jobs, a worker), documented
    # beside the service's own in docs/configuration.md.
    other_settings: tuple[type, ...] = ()
    # Topics (opml_common.topics.Topic) the service publishes or consumes: created at start-up.
    topics: tuple = ()

    @property
    def event_source(self) -> str:
        """The CloudEvents ``source`` of every event the service emits."""
        return f"opml/{self.name}"

    @property
    def env_prefix(self) -> str:
        """The service's settings prefix, e.g. ``OPML_BUNDLE_STORE_``."""
        return self.settings.model_config["env_prefix"]

    def targets(self, env: Mapping[str, str], host: str = "127.0.0.1") -> dict[str, str]:
        """Where a process of the service run with ``env`` is reached: ``<PREFIX>TARGET`` (its gRPC port,
        where the others and the main job find it) and ``<PREFIX><NAME>_TARGET`` for each of its
        :meth:`extra_ports` (the router's INFERENCE_TARGET: its KServe v2 data plane)."""
        prefix = self.env_prefix
        return {f"{prefix}TARGET": f"{host}:{env[f'{prefix}GRPC_PORT']}",
                **{f"{prefix}{name.upper()}_TARGET": f"{host}:{env[f'{prefix}{name.upper()}_PORT']}"
                   for name in self.extra_ports()}}

    def extra_ports(self) -> dict[str, int]:
        """The service's ports besides gRPC and metrics (settings named ``*_port``, e.g. the router's
        ``inference_port``) and their defaults: a stack or a test on free ports picks these free too."""
        return {name[:-len("_port")]: field.default for name, field in self.settings.model_fields.items()
                if name.endswith("_port") and name not in ("grpc_port", "metrics_port")}
