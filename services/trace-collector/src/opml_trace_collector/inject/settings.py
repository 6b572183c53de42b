"""The tracer's settings, from ``OPML_TRACE_*`` variables set by the launcher (or the job's environment)."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class TracerSettings(BaseSettings):
    """Where a traced worker reports, how often, and how big an on-demand capture may get."""

    model_config = SettingsConfigDict(env_prefix="OPML_TRACE_", frozen=True, extra="ignore")

    job: str = Field("adhoc", min_length=1, description="Job name; events are keyed `<job>/<worker>`.")
    worker: str = Field("local", min_length=1, description="Worker name, e.g. `worker-0` (from TF_CONFIG) or `local`.")
    spool_dir: Path = Field(Path("~/.opml/trace-spool").expanduser(),
                            description="Events the broker has not acknowledged yet wait here (one folder per run).")
    session_dir: Path = Field(Path("opml-traces"),
                              description="Where the JSON-lines session file of the run's events is written.")
    flush_interval_s: float = Field(2.0, gt=0, description="Period of the step-metrics batches.")
    poll_s: float = Field(1.0, gt=0, description="Period of the control poll (global on/off, capture requests).")
    exit_timeout_s: float = Field(0.1, ge=0, description="At exit, the most the job waits for the broker to "
                                  "acknowledge the last batch (already in the spool); what it has not acknowledged "
                                  "by then stays in the spool for `opml trace flush` or the next traced run.")
    bucket: str = Field("opml-traces", min_length=3, description="S3 bucket of captured traces.")
    max_trace_events: int = Field(200_000, ge=100, description="Most events one captured trace keeps (ops first).")
    op_filter: str | None = Field(None, description="Regex: a capture keeps only ops whose name or type matches.")
    upload_retry_s: float = Field(300.0, ge=0, description="While S3 cannot be reached, how long a finished "
                                  "capture's upload is retried (the trace waits on local disk); keep it under the "
                                  "collector's capture timeout, after which the capture expires anyway.")

    @field_validator("spool_dir", "session_dir")
    @classmethod
    def _expand(cls, value: Path) -> Path:
        return value.expanduser()

    @field_validator("op_filter")
    @classmethod
    def _valid_regex(cls, value: str | None) -> str | None:
        if value:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"must be a valid regular expression, but {value!r} fails: {exc}") from exc
        return value or None

    @property
    def subject(self) -> str:
        return f"{self.job}/{self.worker}"
