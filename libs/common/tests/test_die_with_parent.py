"""A service's helper process dies with the service, even a SIGKILLed one (``die_with_parent``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

PARENT = """
import multiprocessing, os, sys
from concurrent.futures import ProcessPoolExecutor
from opml_common.process import die_with_parent

if __name__ == "__main__":
    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                               initializer=die_with_parent)
    print(pool.submit(os.getpid).result(), flush=True)
    sys.stdin.read()  # until the test kills this process
"""


def test_a_pool_worker_is_killed_when_its_service_is_sigkilled() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        worker = psutil.Process(int(parent.stdout.readline()))
        assert worker.is_running() and worker.ppid() == parent.pid
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        worker.wait(timeout=60)  # returns once the worker is gone; raises TimeoutExpired if it outlives its parent
    finally:
        parent.kill()
        parent.wait()
