"""Start a worker as a child process and learn its ports (for the control plane, tests and benches).

The worker binds free ports and announces them on its first stdout line; :class:`WorkerProcess`
reads that line, then waits for gRPC health to say SERVING.
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


@dataclass
class WorkerProcess:
    """``python -m opml_inference_router.worker`` of one pool kind; ``start()`` returns once it serves.

    ``stop()`` sends SIGTERM (graceful), then SIGKILL after ``stop_timeout_s``; ``kill()`` is the crash
    a test injects. The worker's logs go to ``log_path``.
    """

    pool_kind: str
    fleet: Path
    log_path: Path
    models_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    startup_timeout_s: float = 60.0
    stop_timeout_s: float = 10.0
    process: subprocess.Popen | None = field(default=None, init=False)
    grpc_port: int | None = field(default=None, init=False)
    metrics_port: int | None = field(default=None, init=False)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self) -> "WorkerProcess":
        if self.process is not None and self.process.poll() is None:
            return self
        args = [sys.executable, "-m", MODULE, "--pool-kind", self.pool_kind, "--fleet", str(self.fleet),
                "--port", "0", "--metrics-port", "0", *self.extra_args]
        if self.models_dir is not None:
            args += ["--models-dir", str(self.models_dir)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(args, env={**os.environ, **self.env}, stdout=subprocess.PIPE,
                                            stderr=log_file, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            announced = self._read_announcement()
            self.grpc_port, self.metrics_port = announced["grpc_port"], announced["metrics_port"]
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

    def __enter__(self) -> "WorkerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
