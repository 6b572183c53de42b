"""Host agent settings: ``OPML_INFERENCE_HOST_*``."""

from __future__ import annotations

import socket
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from opml_common.config import ServiceSettings


class HostAgentSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="OPML_INFERENCE_HOST_", frozen=True, extra="ignore",
                                      hide_input_in_errors=True)

    name: str = Field(default_factory=socket.gethostname,
                      description="The host's stable name (its node name); a host that registers again under it "
                      "gets its fleet places back. Default: the hostname.")
    router_target: str = Field(description="The router's gRPC address (host:port). Required.")
    token: SecretStr = Field(SecretStr(""), description="A host token the router accepts "
                             "(OPML_INFERENCE_ROUTER_HOST_TOKENS): it can register and heartbeat, nothing else.")
    fleet: Path = Field(description="The router's fleet file: the pools joined and their kinds. Required.")
    pools: str = Field(description="Comma-separated fleet pools this host serves a worker of, all at one site. "
                       "Required.")
    advertise: str = Field("", description="The address the router reaches this host at (its agent and "
                           "workers); default: `host` unless it is 0.0.0.0, else the hostname.")
    worker_host: str = Field("0.0.0.0", description="Interface the workers' gRPC binds (the router calls them).")
    home: Path = Field(Path.home() / ".opml" / "inference-host",
                       description="Bundles received, the predictions outbox, worker logs.")
    forward_rate_eps: float = Field(20.0, gt=0, description="Most prediction events a second forwarded to the "
                                    "router (each a batch of up to 100 predictions): bounds a backlog's replay.")
    max_bundle_bytes: int = Field(8 * 1024**3, ge=1, description="Largest bundle the agent accepts.")
    worker_startup_timeout_s: float = Field(60.0, gt=0, description="How long a worker may take to serve.")
    worker_threads_per_replica: int = Field(0, ge=0, description="Intra-op threads per replica (0: cores / slots).")

    @property
    def advertised_host(self) -> str:
        if self.advertise:
            return self.advertise
        return self.host if self.host not in ("0.0.0.0", "::") else socket.gethostname()

    def pool_names(self) -> list[str]:
        return [name.strip() for name in self.pools.split(",") if name.strip()]
