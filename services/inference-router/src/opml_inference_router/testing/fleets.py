"""Fleets for tests and benches that start the router as a process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

# One worker of each kind: a cpu kind (fp32 and int8) and an int8 accelerator kind with fixed batch shapes,
# both on this machine's CPU, so a model can be measured on one kind and transferred to the other.
CPU_AND_ACCEL: dict[str, Any] = {
    "pool_kinds": [
        {"name": "cpu", "precisions": ["fp32", "int8"], "memory_mib": 2048, "slots": 2, "cost_per_hour": 0.4,
         "execution_provider": "CPUExecutionProvider"},
        {"name": "accel", "precisions": ["int8"], "memory_mib": 1024, "slots": 2, "cost_per_hour": 0.2,
         "execution_provider": "CPUExecutionProvider", "batch_sizes": [1, 8, 32]},
    ],
    "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}, {"name": "accel", "kind": "accel", "workers": 1}],
    "min_replicas": 1,
}


def fleet_env(path: Path, fleet: dict[str, Any] = CPU_AND_ACCEL) -> dict[str, str]:
    """Write ``fleet`` to ``path``; the router's variables that load it, one intra-op thread per replica
    (the measurements of serving configurations then vary only what they set)."""
    path.write_text(yaml.safe_dump(fleet))
    return {"OPML_INFERENCE_ROUTER_FLEET": str(path), "OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA": "1"}
