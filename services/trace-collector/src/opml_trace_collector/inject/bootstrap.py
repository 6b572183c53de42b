"""What ``sitecustomize`` does in a traced process: keep spare frame-stack chunks, hook TensorFlow's
import, warn if it never comes.

Standard library only, and the tracer's small C module (``spare_chunks``). The warning about a
program that never imported TensorFlow is printed by the first traced process of a job only (its
children inherit ``OPML_TRACE_NESTED``), so helper subprocesses stay quiet.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from types import ModuleType

from opml_trace_collector.inject import hooks

TARGET = "tensorflow"
_NESTED = "OPML_TRACE_NESTED"


def warn(message: str) -> None:
    """One line on stderr, where a person running the job sees it whatever its logging setup."""
    sys.stderr.write(f"opml-trace: WARNING: {message}\n")
    sys.stderr.flush()


def _on_tensorflow(module: ModuleType) -> None:
    began = time.thread_time()
    try:
        from opml_trace_collector.inject import tracer
        tracer.activate(module)
        tracer.startup_cpu_s = time.thread_time() - began  # the job thread's share (the bench reads it)
    except Exception as exc:  # noqa: BLE001 - never break the job
        warn(f"the tracer failed to start ({exc!r}); the job runs untraced")


def _untraced_warning() -> None:
    if TARGET not in sys.modules:
        warn("the program did not import TensorFlow; it ran untraced")


def _keep_spare_chunks() -> None:
    """From the process's start, so that ``import tensorflow`` (deep, churn-prone) gets them too."""
    try:
        from opml_trace_collector.inject import spare_chunks
        spare_chunks.keep_spare_chunks()
    except ImportError as exc:  # a build without the C module: traced all the same
        warn(f"frame-stack chunks are not kept ({exc}); the tracer's frames may move CPython's chunk churn")


def install() -> None:
    _keep_spare_chunks()
    if os.environ.get(_NESTED) != "1":
        os.environ[_NESTED] = "1"
        atexit.register(_untraced_warning)
    hooks.when_imported(TARGET, _on_tensorflow)
