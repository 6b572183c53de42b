"""job-orchestrator settings: ``OPML_JOB_ORCHESTRATOR_*`` (the shared ones are in opml_common.config).

The cluster the scheduler packs jobs onto is ``NODES``, a JSON list such as
``[{"name": "gpu-0", "cpu_millis": 64000, "memory_mib": 515000, "gpu": 8}, ...]``; by default one
node, this machine, with its cores and memory and no GPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator
from pydantic_settings import SettingsConfigDict

from opml_common.config import ServiceSettings


class NodeConfig(BaseModel):
    """One node of the cluster and what it offers to jobs."""

    model_config = {"frozen": True, "extra": "forbid"}

    name: str = Field(min_length=1)
    cpu_millis: int = Field(ge=0)
    memory_mib: int = Field(ge=0)
    gpu: int = Field(0, ge=0)


def this_machine() -> list[NodeConfig]:
    """One node: this machine's cores and physical memory, no GPU."""
    memory_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2 ** 20
    return [NodeConfig(name="local", cpu_millis=(os.cpu_count() or 1) * 1000, memory_mib=memory_mib)]


class JobOrchestratorSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="OPML_JOB_ORCHESTRATOR_", frozen=True, extra="ignore")

    grpc_port: int = Field(50052, ge=0, le=65535, description="gRPC port (0 picks a free one).")
    metrics_port: int = Field(9152, ge=0, le=65535, description="Prometheus /metrics port (0 picks a free one).")
    home: Path = Field(Path.home() / ".opml" / "job-orchestrator",
                       description="Directory of the jobs' work (logs, run manifests) and the event outbox.")
    nodes: list[NodeConfig] | None = Field(None, min_length=1, description="The cluster: a JSON list of "
                                           "{name, cpu_millis, memory_mib, gpu}; unset: this machine (its cores "
                                           "and memory, no GPU).")
    policy: Literal["fifo", "fifo+backfill", "te-be", "te-be+backfill", "te-be+"] = Field(
        "te-be+", description="Scheduling policy preset (see the README's Policies).")
    max_retries: int = Field(3, ge=0, description="Retries of a failed run when the job spec sets none.")
    retry_base_delay_s: float = Field(1.0, ge=0, description="Delay before the first retry; doubles each time.")
    retry_max_delay_s: float = Field(60.0, ge=0, description="Longest delay between retries.")
    terminate_grace_s: float = Field(30.0, ge=0, description="SIGTERM-to-kill grace of a preempted or cancelled "
                                     "run (time for a BE job to write its checkpoint).")
    watch_backlog: int = Field(1000, ge=1, description="Changes a watch stream may fall behind before it is ended.")
    log_poll_s: float = Field(0.2, gt=0, description="How often `logs --follow` looks for new output.")

    def cluster_nodes(self) -> list[NodeConfig]:
        """The configured nodes, or this machine."""
        return self.nodes or this_machine()

    @model_validator(mode="after")
    def _checks(self) -> "JobOrchestratorSettings":
        names = [node.name for node in self.nodes or ()]
        if len(set(names)) != len(names):
            raise ValueError(f"nodes must have unique names, but got {names}")
        if self.retry_max_delay_s < self.retry_base_delay_s:
            raise ValueError("retry_max_delay_s must be >= retry_base_delay_s")
        return self
