"""bundle-store settings: ``OPML_BUNDLE_STORE_*`` (the shared ones are in opml_common.config)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from opml_common.config import ServiceSettings


class BundleStoreSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="OPML_BUNDLE_STORE_", frozen=True, extra="ignore")

    grpc_port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 picks a free one).")
    metrics_port: int = Field(9151, ge=0, le=65535, description="Prometheus /metrics port (0 picks a free one).")
    home: Path = Field(Path.home() / ".opml" / "bundle-store",
                       description="Directory holding the service's local contexts, blobs and outbox.")
    transfer_workers: int = Field(32, ge=1, le=256, description="Parallel S3 transfers per push or pull.")
