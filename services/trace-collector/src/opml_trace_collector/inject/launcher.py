"""Start a command traced: same command, same arguments, only the environment changes.

``build_env`` is what the job-orchestrator's executor and ``opml trace run`` share: PYTHONPATH
gets ``boot/`` (whose sitecustomize hooks TensorFlow's import) and ``OPML_TRACE_JOB`` /
``OPML_TRACE_WORKER`` name the worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path

BOOT_DIR = Path(__file__).resolve().parent / "boot"


def default_worker(env: Mapping[str, str]) -> str:
    """``<type>-<index>`` of TF_CONFIG's task (``worker-0``, ``chief-0``), else ``local``."""
    try:
        task = json.loads(env.get("TF_CONFIG") or "{}").get("task") or {}
        if task.get("type"):
            return f"{task['type']}-{int(task.get('index', 0))}"
    except (ValueError, TypeError, AttributeError):
        pass
    return "local"


def build_env(job: str, worker: str | None, base_env: Mapping[str, str]) -> dict[str, str]:
    """``base_env`` plus what traces a Python process started with it."""
    if not job:
        raise ValueError("job must be non-empty")
    env = dict(base_env)
    paths = [str(BOOT_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(BOOT_DIR)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["OPML_TRACE_JOB"] = job
    env["OPML_TRACE_WORKER"] = worker or default_worker(base_env)
    env.pop("OPML_TRACE_NESTED", None)
    return env


def run_traced(argv: list[str], *, job: str, worker: str | None) -> int:
    """Run ``argv`` traced and return its exit code (128+N when a signal N ended it).

    SIGINT and SIGTERM sent to the launcher are passed on to the job, which decides how to stop.
    """
    if not argv:
        raise ValueError("argv must name a command to run")
    process = subprocess.Popen(argv, env=build_env(job, worker, os.environ))
    forwarded = {sig: signal.signal(sig, lambda signum, _frame: process.send_signal(signum))
                 for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = process.wait()
    finally:
        for sig, handler in forwarded.items():
            signal.signal(sig, handler)
    return code if code >= 0 else 128 - code
