"""The local platform (`make up` / `make down`): infrastructure, every installed service, the main job.

``up`` starts the embedded infrastructure on its default ports, then each service published under
the ``opml.services`` entry points on its default ports, prints where everything listens, runs the
main job, and keeps running until Ctrl-C or ``down`` (SIGTERM to the pid in .opml/stack.pid).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

from opml_common.devinfra import DevInfra
from opml_common.grpc.server import wait_for_signal
from opml_common.process import ServiceProcess, ServiceSpec

STATE_DIR = Path(".opml")
PID_FILE = STATE_DIR / "stack.pid"


def installed_services() -> list[ServiceSpec]:
    return [entry.load().SPEC for entry in sorted(entry_points(group="opml.services"), key=lambda e: e.name)]


def up(main_job: Path | None) -> int:
    if PID_FILE.exists() and _alive(int(PID_FILE.read_text())):
        print(f"the stack already runs (pid {PID_FILE.read_text()}); `make down` stops it")
        return 1
    STATE_DIR.mkdir(exist_ok=True)
    PID_FILE.write_text(str(os.getpid()))
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `make down` stops us like Ctrl-C
    services: list[ServiceProcess] = []
    try:
        with DevInfra(workdir=STATE_DIR / "infra", kafka_port=9092, s3_port=8333) as endpoints:
            env = {**endpoints.env(), "OPML_LOG_FORMAT": "text"}
            os.environ.update(env)
            print("infrastructure:")
            print(f"  kafka   {endpoints.kafka_bootstrap}  (tansu)")
            print(f"  s3      {endpoints.s3_endpoint}  (SeaweedFS, key {endpoints.s3_access_key})")
            print(f"  redis   {endpoints.redis_url}")
            print("services:")
            for spec in installed_services():
                settings = spec.settings()
                process = ServiceProcess(spec.module, settings.grpc_port, env, STATE_DIR / "logs" / f"{spec.name}.log")
                services.append(process.start())
                print(f"  {spec.name:<18} grpc {process.target}  metrics http://127.0.0.1:{settings.metrics_port}/metrics"
                      f"  log {process.log_path}")
            if main_job is not None:
                print(f"\nmain job: {main_job}\n", flush=True)
                result = subprocess.run([sys.executable, str(main_job)], env={**os.environ, **env})
                print(f"\nmain job {'succeeded' if result.returncode == 0 else f'FAILED ({result.returncode})'}")
            print("\nthe platform is up; Ctrl-C or `make down` stops it", flush=True)
            asyncio.run(wait_for_signal())
    except KeyboardInterrupt:
        pass
    finally:
        print("\nstopping...", flush=True)
        for process in reversed(services):
            process.stop()
        PID_FILE.unlink(missing_ok=True)
    print("stopped")
    return 0


def down(timeout_s: float = 30.0) -> int:
    if not PID_FILE.exists():
        print("the stack is not running")
        return 0
    pid = int(PID_FILE.read_text())
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    PID_FILE.unlink(missing_ok=True)
    print("stopped")
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m opml_common.stack", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    up_parser = commands.add_parser("up")
    up_parser.add_argument("--main-job", type=Path, default=None)
    commands.add_parser("down")
    args = parser.parse_args()
    return up(args.main_job) if args.command == "up" else down()


if __name__ == "__main__":
    sys.exit(main())
