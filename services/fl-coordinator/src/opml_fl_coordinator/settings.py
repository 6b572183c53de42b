"""fl-coordinator settings: ``OPML_FL_COORDINATOR_*`` (the shared ones are in opml_common.config)."""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from opml_common.config import ServiceSettings


class FlCoordinatorSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="OPML_FL_COORDINATOR_", frozen=True, extra="ignore")

    grpc_port: int = Field(50057, ge=0, le=65535, description="gRPC port (0 picks a free one).")
    metrics_port: int = Field(9157, ge=0, le=65535, description="Prometheus /metrics port (0 picks a free one).")
    home: Path = Field(Path.home() / ".opml" / "fl-coordinator", description="Directory of the event outbox.")
    grpc_max_receive_bytes: int = Field(8 << 20, ge=64 << 10, description="Largest gRPC message accepted: "
                                        "weights come in chunks, so this bounds a chunk, not a model.")
    bucket: str = Field("opml-fl", min_length=3, max_length=63, description="S3 bucket of every completed "
                        "round's global model (and server-optimizer state).")
    max_federations: int = Field(100, ge=1, description="Federations kept (running or ended); creating more is "
                                 "refused with RESOURCE_EXHAUSTED.")
    max_clients_per_federation: int = Field(10_000, ge=1, description="Clients one federation may register.")
    max_model_bytes: int = Field(1 << 30, ge=1024, description="Largest model (sum of its arrays' bytes) a "
                                 "client may upload; larger uploads are refused as they arrive.")
    chunk_bytes: int = Field(1 << 20, ge=1024, le=4 << 20, description="Bytes of array data per chunk sent.")
    bundle_store_target: str = Field(
        "", validation_alias=AliasChoices("OPML_FL_COORDINATOR_BUNDLE_STORE_TARGET", "OPML_BUNDLE_STORE_TARGET"),
        description="host:port of bundle-store: each completed round's model is committed there as a bundle with "
        "lineage (also read from OPML_BUNDLE_STORE_TARGET, which `make up` sets; empty: not published).")
    bundle_store_token: SecretStr = Field(SecretStr(""), description="Bearer token for bundle-store (writer).")
    bundle_context: str = Field("federated", min_length=1, description="bundle-store context of the models.")
    serve_models: bool = Field(True, description="Tag published ONNX models serve=true, so the inference-router "
                               "deploys each as it is committed (flow 3), for federations whose config does not "
                               "set `serve`.")
    publish_every_round: bool = Field(False, description="Publish every round's model (else only the last, when "
                                      "the federation ends).")

    @model_validator(mode="after")
    def _chunks_fit_messages(self) -> FlCoordinatorSettings:
        if self.chunk_bytes + (32 << 10) > self.grpc_max_receive_bytes:
            raise ValueError("chunk_bytes must be at least 32 KiB below grpc_max_receive_bytes (a chunk and its "
                             "header travel in one message)")
        return self
