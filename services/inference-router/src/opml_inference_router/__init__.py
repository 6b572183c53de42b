"""Inference router (after Microsoft's Deep Learning Inference Service, DeepCPU and Google's ML
accelerators): serves ONNX models from bundles on pools of CPU, GPU and accelerator workers.

``placement`` is the transport-free "model master": model and pool-kind configuration, profiles,
the latency model, placement policies, the planner and capacity-safe moves. ``sim`` runs that same
code over a synthetic fleet and checks the result with a discrete-event simulation.
"""

from importlib import metadata


def package_version() -> str:
    """This package's installed version, "0" when run from a source tree (what servers report)."""
    try:
        return metadata.version("opml-inference-router")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0"
