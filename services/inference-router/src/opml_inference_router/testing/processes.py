"""The processes a router runs, told apart: its workers, and its native inference front."""

from __future__ import annotations

import psutil

from opml_inference_router.native_front import BINARY_NAME


def worker_processes(router_pid: int) -> list[psutil.Process]:
    """The router's worker processes (its children but the native front)."""
    return [child for child in psutil.Process(router_pid).children() if child.name() != BINARY_NAME]


def front_process(router_pid: int) -> psutil.Process:
    """The router's native inference front. Raises ValueError unless it runs exactly one."""
    (front,) = [child for child in psutil.Process(router_pid).children() if child.name() == BINARY_NAME]
    return front
