"""Start a command traced: same command, same arguments, only the environment changes.

``build_env`` is what the job-orchestrator's executor and ``opml trace run`` share: PYTHONPATH
gets ``boot/`` (whose sitecustomize hooks TensorFlow's import) and ``OPML_TRACE_JOB`` /
``OPML_TRACE_WORKER`` name the worker. ``run_traced`` also starts the host's shipper
(``ensure_shipper``) when none delivers the job's outlet, detached: the job never waits for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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


def ensure_shipper(env: Mapping[str, str]) -> int | None:
    """Hold the job's outlet as a launcher (the descriptor returned: keep it for the job's life, so an
    idle shipper does not exit meanwhile) and start a shipper for it unless one holds its lock, in a
    session of its own (the job's signals do not reach it). It exits after
    ``OPML_TRACE_SHIPPER_IDLE_EXIT_S`` with no run and no launcher; two started at once: the second
    finds the lock taken and exits. Invalid settings: None (the job's tracer says what is wrong)."""
    from opml_trace_collector.inject import config, spool
    try:
        settings = config.read(env)
    except config.ConfigError:
        return None
    held = spool.hold_launcher(settings.outlet)
    if spool.shipper_pid(settings.outlet) is None:
        clean = {k: v for k, v in env.items() if k != "OPML_TRACE_NESTED"}
        with open(settings.outlet / "shipper.log", "ab") as log:
            subprocess.Popen([sys.executable, "-m", "opml_trace_collector.inject.ship", "--spool-dir",
                              str(settings.spool_dir), "--idle-exit-s", f"{settings.shipper_idle_exit_s:g}"],
                             env=clean, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    return held


def run_traced(argv: list[str], *, job: str, worker: str | None, shipper: bool = True) -> int:
    """Run ``argv`` traced and return its exit code (128+N when a signal N ended it); ``shipper``: start
    the host's shipper first if none runs.

    SIGINT and SIGTERM sent to the launcher are passed on to the job, which decides how to stop.
    """
    if not argv:
        raise ValueError("argv must name a command to run")
    held = ensure_shipper(os.environ) if shipper else None
    try:
        process = subprocess.Popen(argv, env=build_env(job, worker, os.environ))
        forwarded = {sig: signal.signal(sig, lambda signum, _frame: process.send_signal(signum))
                     for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = process.wait()
        finally:
            for sig, handler in forwarded.items():
                signal.signal(sig, handler)
    finally:
        if held is not None:
            os.close(held)
    return code if code >= 0 else 128 - code
