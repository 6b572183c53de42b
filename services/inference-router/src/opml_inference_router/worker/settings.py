"""Worker settings: ``OPML_INFERENCE_ROUTER_WORKER_*`` (command-line flags override them)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from opml_common.config import ServiceSettings


class WorkerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="OPML_INFERENCE_ROUTER_WORKER_", frozen=True, extra="ignore")

    pool_kind: str = Field("cpu", description="The pool kind (declared in the fleet file) this worker is one of.")
    fleet: Path | None = Field(None, description="Fleet file declaring the pool kinds. Required.")
    models_dir: Path | None = Field(
        None, description="Directory of model bundles (<name>/model.yaml ...) that RepositoryModelLoad finds by "
        "name; without it, loads must name the bundle's path.")
    uds: Path | None = Field(
        None, description="Also serve inference on this Unix domain socket, for a router on the same machine "
        "(a cheaper hop than gRPC; announced as \"uds\"). Health, metrics and the rest stay on gRPC/TCP.")
    threads_per_replica: int = Field(
        0, ge=0, description="Intra-op threads of each replica; 0: the worker's cores divided by the kind's slots.")
    parent_pid: int | None = Field(
        None, ge=1, description="Exit when this process (the router that started us) is gone: workers run in "
        "sessions of their own, so a router killed with SIGKILL would otherwise leave them serving.")
    profile_repeats: int = Field(20, ge=3, description="Timed runs per batch size when a load asks for a profile.")
