"""Start a worker as a child process and learn its ports (for the control plane, tests and benches).

The worker binds free ports and announces them on its first stdout line; :class:`WorkerProcess`
reads that line, then waits for gRPC health to say SERVING. With ``uds``, the worker also serves on
that Unix domain socket (:mod:`.uds`), the cheaper hop for a router on the same machine
(:attr:`local_target`).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from opml_common.process import terminate, wait_until_serving

MODULE = "opml_inference_router.worker"
UDS_SCHEME = "uds:"  # opml_inference_router.worker.uds.SCHEME, without importing grpc here
MAX_UDS_PATH = 107  # bytes of a socket path: sockaddr_un.sun_path less its terminating NUL (Linux)


@dataclass
class WorkerProcess:
    """``python -m opml_inference_router.worker`` of one pool kind; ``start()`` returns once it serves.

    ``stop()`` sends SIGTERM (graceful), then SIGKILL after ``stop_timeout_s``; ``kill()`` is the crash
    a test injects. The worker's logs go to ``log_path``. ``uds``: a socket path (at most 107 bytes)
    where the worker also serves inference to a local router (:mod:`.uds`, address
    :attr:`uds_target`); gRPC (health, admin, everything) stays on TCP (:attr:`target`).
    """

    pool_kind: str
    fleet: Path
    log_path: Path
    models_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    uds: Path | None = None
    startup_timeout_s: float = 60.0
    stop_timeout_s: float = 10.0
    process: subprocess.Popen | None = field(default=None, init=False)
    grpc_port: int | None = field(default=None, init=False)
    metrics_port: int | None = field(default=None, init=False)
    uds_target: str | None = field(default=None, init=False)

    @property
    def target(self) -> str:
        """The TCP address (health, metrics' peer, callers on other machines)."""
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def local_target(self) -> str:
        """The address a router on this machine should use: the Unix socket when served, else TCP."""
        return self.uds_target or self.target

    def start(self) -> WorkerProcess:
        if self.process is not None and self.process.poll() is None:
            return self
        args = [sys.executable, "-m", MODULE, "--pool-kind", self.pool_kind, "--fleet", str(self.fleet),
                "--port", "0", "--metrics-port", "0", "--parent-pid", str(os.getpid()), *self.extra_args]
        if self.models_dir is not None:
            args += ["--models-dir", str(self.models_dir)]
        if self.uds is not None:
            args += ["--uds", str(self.uds)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(args, env={**os.environ, **self.env}, stdout=subprocess.PIPE,
                                            stderr=log_file, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            announced = self._read_announcement()
            self.grpc_port, self.metrics_port = announced["grpc_port"], announced["metrics_port"]
            self.uds_target = f"{UDS_SCHEME}{announced['uds']}" if announced.get("uds") else None
            wait_until_serving(self.target, timeout_s=self.startup_timeout_s, process=self.process,
                               log_path=self.log_path)
        except BaseException:
            self.kill()
            raise
        return self

    def _read_announcement(self) -> dict:
        assert self.process is not None and self.process.stdout is not None
        deadline = time.monotonic() + self.startup_timeout_s
        line = b""
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"worker did not announce its ports within {self.startup_timeout_s}s")
            ready, _, _ = select.select([self.process.stdout], [], [], min(remaining, 0.2))
            if ready:
                chunk = os.read(self.process.stdout.fileno(), 4096)
                if not chunk:
                    self.process.wait()
                    tail = self.log_path.read_text()[-3000:] if self.log_path.exists() else ""
                    raise RuntimeError(f"worker exited with {self.process.returncode} before serving:\n{tail}")
                line += chunk
        return json.loads(line.decode())

    def stop(self) -> None:
        if self.process is not None:
            terminate(self.process, timeout_s=self.stop_timeout_s)
            self._close_pipe()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._close_pipe()

    def _close_pipe(self) -> None:
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()

    def __enter__(self) -> WorkerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
