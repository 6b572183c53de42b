"""automl-controller settings: ``OPML_AUTOML_CONTROLLER_*`` (the shared ones are in opml_common.config)."""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from opml_common.config import ServiceSettings


class AutomlControllerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="OPML_AUTOML_CONTROLLER_", frozen=True, extra="ignore")

    grpc_port: int = Field(50055, ge=0, le=65535, description="gRPC port (0 picks a free one).")
    metrics_port: int = Field(9155, ge=0, le=65535, description="Prometheus /metrics port (0 picks a free one).")
    home: Path = Field(Path.home() / ".opml" / "automl-controller", description="Directory of the event outbox.")
    trials_dir: Path = Field(Path("/var/tmp/opml-automl-trials"), description="Where each trial's own model folder "
                             "is ({job id}: the trial's job's checkpoint.dir, made by the job-orchestrator for the "
                             "job's user; kept until its experiment is deleted). Outside HOME, which no job's user "
                             "may enter. Made mode 0711 at start (a job's user reaches its own folder and lists "
                             "none); refused if it is a symlink, another user's, or in a folder others may change.")
    job_orchestrator_target: str = Field(
        "127.0.0.1:50052", min_length=1,
        validation_alias=AliasChoices("OPML_AUTOML_CONTROLLER_JOB_ORCHESTRATOR_TARGET", "OPML_JOB_ORCHESTRATOR_TARGET"),
        description="The job-orchestrator every trial's job is submitted to (also read from "
        "OPML_JOB_ORCHESTRATOR_TARGET, which `make up` sets).")
    job_orchestrator_token: SecretStr | None = Field(None, description="Bearer token the controller calls the "
                                                     "orchestrator with (the writer role: it submits and cancels "
                                                     "the trials' jobs). Unset: no token (an orchestrator with "
                                                     "auth off).")
    trial_python: str | None = Field(None, min_length=1, description="Interpreter that runs the File "
                                     "collector's wrapper (`-m opml_automl_controller.filetail`) in a trial's "
                                     "job; unset: the controller's own (jobs on this machine); where the "
                                     "orchestrator runs pods, the image's python.")
    bundle_store_target: str | None = Field(
        None, min_length=1,
        validation_alias=AliasChoices("OPML_AUTOML_CONTROLLER_BUNDLE_STORE_TARGET", "OPML_BUNDLE_STORE_TARGET"),
        description="The bundle-store trials upload their models to (each with an upload grant of its own) and the "
        "best one is committed to when an experiment ends (also read from OPML_BUNDLE_STORE_TARGET, which `make up` "
        "sets); unset: experiments with spec.model are refused.")
    bundle_store_token: SecretStr | None = Field(None, description="Bearer token (writer) for the bundle-store: the "
                                                 "controller's own, never given to a trial (a trial gets an upload "
                                                 "grant for its own bundle).")
    bundle_store_trial_target: str | None = Field(None, min_length=1, description="The bundle-store's address as "
                                                  "trials' jobs reach it (another network, a service name); unset: "
                                                  "BUNDLE_STORE_TARGET.")
    upload_grant_ttl_s: int = Field(24 * 3600, ge=60, le=7 * 24 * 3600, description="How long a trial's upload "
                                    "grant is valid from its job's submit (a trial queued or training longer "
                                    "cannot upload its model).")
    model_context: str = Field("automl", min_length=1, description="The bundle-store context of the trials' uploaded "
                               "models and of the best ones.")
    trace_wait_s: float = Field(10.0, gt=0, description="Trace collector: how long after a trial's job "
                                "succeeded the controller waits for its tracer's last epoch logs (every tracer "
                                "run's TracerStopped); also the tracer's exit bound in the trial's job "
                                "(OPML_TRACE_EXIT_TIMEOUT_S) unless the trial template sets one.")
    trace_metrics: bool = Field(True, description="Consume opml.traces.v1 for the Trace collector kind (off: "
                                "experiments with collector kind Trace get no metrics).")
    inference_router_target: str | None = Field(
        None, min_length=1,
        validation_alias=AliasChoices("OPML_AUTOML_CONTROLLER_INFERENCE_ROUTER_TARGET", "OPML_INFERENCE_ROUTER_TARGET"),
        description="The inference-router whose PredictServingPerformance evaluates ServingConfigSurrogate trials "
        "(also read from OPML_INFERENCE_ROUTER_TARGET, which `make up` sets); unset: experiments of that kind are "
        "refused.")
    inference_router_token: SecretStr | None = Field(None, description="Bearer token (reader) for the "
                                                     "inference-router.")
    retry_s: float = Field(1.0, gt=0, description="Pause before retrying an orchestrator call that failed "
                           "with a retriable error (UNAVAILABLE, DEADLINE_EXCEEDED).")
    lease_ttl_s: float = Field(10.0, ge=1, le=300, description="The automl-controller leader lease's TTL: the "
                               "replica holding it runs the experiments' loops; after a leader dies (no clean "
                               "release) another replica takes over within this long. It is renewed every third.")
    resync_s: float = Field(5.0, gt=0, le=300, description="How often the leader reads every experiment for one "
                            "whose loop it does not run (created, stopped or resumed on a follower whose nudge "
                            "was lost).")

    @field_validator("trials_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        if not value.is_absolute():
            raise ValueError("must be an absolute path (the orchestrator refuses a relative checkpoint.dir)")
        return value

    @field_validator("job_orchestrator_token", "trial_python", "bundle_store_target", "bundle_store_token",
                     "bundle_store_trial_target",
                     "inference_router_target", "inference_router_token", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value
