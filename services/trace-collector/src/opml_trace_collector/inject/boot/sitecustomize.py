"""Imported by Python at start-up in a traced job (the launcher puts this folder on PYTHONPATH).

It costs almost nothing: it registers a post-import hook on ``tensorflow`` and returns; the tracer
is imported only when the job imports TensorFlow. Then it runs the sitecustomize this one shadows.
"""

import os
import sys


def _chain() -> None:
    """Run the next ``sitecustomize`` on sys.path (a site's own), which this file shadows."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def _boot() -> None:
    try:
        from opml_trace_collector.inject import bootstrap
    except Exception as exc:  # noqa: BLE001 - never break the job: run it untraced
        sys.stderr.write(f"opml-trace: WARNING: the tracer cannot load ({exc!r}); the job runs untraced\n")
        return
    bootstrap.install()


_boot()
_chain()
