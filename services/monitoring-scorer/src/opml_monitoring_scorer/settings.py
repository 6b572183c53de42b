"""monitoring-scorer settings: ``OPML_MONITORING_SCORER_*`` (the shared ones are in opml_common.config)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from opml_common.config import ServiceSettings
from opml_inference_router_contract.names import EVENT_SOURCE as ROUTER_SOURCE
from opml_monitoring_scorer_contract.names import LABEL_SOURCE

MAX_SOURCE_CHARS = 256


class MonitoringScorerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="OPML_MONITORING_SCORER_", frozen=True, extra="ignore")

    grpc_port: int = Field(50056, ge=0, le=65535, description="gRPC port (0 picks a free one).")
    metrics_port: int = Field(9156, ge=0, le=65535, description="Prometheus /metrics port (0 picks a free one).")
    home: Path = Field(Path.home() / ".opml" / "monitoring-scorer",
                       description="Directory of the event outbox, the faust app's data and fetched bundles.")
    bundle_store_target: str = Field(
        "127.0.0.1:50051", min_length=1,
        validation_alias=AliasChoices("OPML_MONITORING_SCORER_BUNDLE_STORE_TARGET", "OPML_BUNDLE_STORE_TARGET"),
        description="host:port of the bundle-store, where reference bundles are read (also read from "
        "OPML_BUNDLE_STORE_TARGET).")
    bundle_store_token: SecretStr = Field(SecretStr(""), description="Bearer token the scorer calls the "
                                          "bundle-store with (reader role); empty: none (dev).")
    label_retention_s: int = Field(7 * 86_400, ge=60, le=90 * 86_400,
                                   description="How long a prediction waits for its label (and a label for its "
                                   "prediction) before the join forgets it.")
    label_sources: Annotated[tuple[str, ...], NoDecode] = Field(
        (LABEL_SOURCE,), description="CloudEvents sources whose labels (opml.labels.v1) are accepted for every model, "
        "comma separated (empty: none); a model's monitoring.yaml adds its own (labels.producers). A label from any "
        f"other source is dead-lettered as UntrustedSource. {LABEL_SOURCE}: the source of the platform's own label "
        "tools.")
    prediction_sources: Annotated[tuple[str, ...], NoDecode] = Field(
        (ROUTER_SOURCE,), description="CloudEvents sources whose predictions (opml.predictions.v1) are scored, comma "
        "separated (empty: none). A prediction from any other source is dead-lettered as UntrustedSource, so only "
        f"what the platform served feeds the windows, estimates and alerts. {ROUTER_SOURCE}: the inference-router's.")
    autoregister: bool = Field(True, description="Monitor every version the inference-router deploys "
                               "(opml.deployments.v1): from its bundle's reference.npz and monitoring.yaml, or, "
                               "deployed from a directory, with its first window as the baseline.")
    seed: int = Field(0, description="Seed of the MPP's secondary models (reproducible estimates).")
    mpp_refit_quiet_s: float = Field(
        5.0, gt=0, le=3600, description="Seconds without a new label after which the MPP is recalibrated on the "
        "labels that came since its last recalibration, when they are fewer than the 200 that start one at once "
        "(so the last labels of a burst are learned too).")

    @field_validator("label_sources", "prediction_sources", mode="before")
    @classmethod
    def _split_sources(cls, value: Any) -> Any:
        """A comma-separated list, each source 1-256 characters."""
        if isinstance(value, str):
            value = tuple(source.strip() for source in value.split(",") if source.strip())
        if isinstance(value, (list, tuple, set, frozenset)):
            for source in value:
                if not isinstance(source, str) or not 0 < len(source) <= MAX_SOURCE_CHARS:
                    raise ValueError(f"each source must hold 1-{MAX_SOURCE_CHARS} characters")
        return value
