"""Run a service as a child process and know when it is ready (the dev stack and tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from opml_common.process import terminate, wait_until_serving


@dataclass
class ServiceProcess:
    """``python -m <module>`` with extra environment; ``start()`` returns once gRPC health is SERVING.

    ``stop()`` sends SIGTERM (graceful shutdown), then SIGKILL after ``stop_timeout_s``; ``kill()``
    is the crash a test injects. Output goes to ``log_path``.
    """

    module: str
    grpc_port: int
    env: dict[str, str]
    log_path: Path
    startup_timeout_s: float = 60.0
    stop_timeout_s: float = 10.0
    process: subprocess.Popen | None = field(default=None, init=False)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self) -> ServiceProcess:
        if self.process is not None and self.process.poll() is None:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-m", self.module], env={**os.environ, **self.env},
                stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_until_serving(self.target, timeout_s=self.startup_timeout_s, process=self.process,
                               log_path=self.log_path, env={**os.environ, **self.env})
        except BaseException:
            self.kill()
            raise
        return self

    def stop(self) -> None:
        if self.process is not None:
            terminate(self.process, timeout_s=self.stop_timeout_s)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
