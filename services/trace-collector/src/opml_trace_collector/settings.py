"""trace-collector settings: ``OPML_TRACE_COLLECTOR_*`` (the shared ones are in opml_common.config)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from opml_common.config import ServiceSettings


class TraceCollectorSettings(ServiceSettings):
    """The service's own settings, validated at start-up; every field has a working default."""

    model_config = SettingsConfigDict(env_prefix="OPML_TRACE_COLLECTOR_", frozen=True, extra="ignore")

    grpc_port: int = Field(50054, ge=0, le=65535, description="gRPC port (0 picks a free one).")
    metrics_port: int = Field(9154, ge=0, le=65535, description="Prometheus /metrics port (0 picks a free one).")
    bucket: str = Field("opml-traces", min_length=3, max_length=63,
                        description="S3 bucket of the capture traces (s3://BUCKET/traces/JOB/CAPTURE/WORKER...).")
    capture_timeout_s: float = Field(
        600.0, gt=0, description="A capture whose workers have not all answered by then expires (a worker killed "
                                 "mid-capture never announces).")
    series_length: int = Field(10000, ge=10, description="Step records kept per run for GetStepSeries (the oldest "
                                                         "go first); per-signature aggregates cover every step.")
    run_lost_after_s: float = Field(300.0, gt=0, description="A run silent this long without TracerStopped is LOST.")
    summary_sample_steps: int = Field(
        10000, ge=10, description="Step records GetSummary reads for the step-time percentiles (the newest of "
                                   "each run, shared evenly); counts, means and throughput cover every step.")
    state_check_interval_s: float = Field(
        5.0, gt=0, description="How often the service checks that its Redis state is still there; state lost "
                               "while running is rebuilt from the topic.")
    consumer_group: str = Field(
        "trace-collector", min_length=1, description="Kafka consumer group of the aggregator, suffixed with the "
                                                     "generation of the Redis state (GROUP.GENERATION): a new "
                                                     "generation replays the topic from its beginning.")
