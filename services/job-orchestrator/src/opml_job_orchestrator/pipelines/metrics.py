"""The pipelines' Prometheus metrics (``opml_job_orchestrator_pipeline_*``)."""

from __future__ import annotations

from opml_common.metrics import ServiceMetrics

STEP_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600)
STEP_OUTCOMES = ("ran", "cached", "failed", "skipped")
TRIGGER_SOURCES = ("rpc", "span", "alert", "schedule")


class PipelineMetrics:
    """``pipeline_runs_total{state}`` (runs ended), ``pipeline_steps_total{kind,outcome}`` (ran, cached,
    failed, skipped), ``pipeline_step_duration_seconds{kind}`` (steps that ran), ``pipeline_triggers_total
    {source,outcome}`` (started a run, coalesced into the next, ignored), ``pipeline_runs_active`` and
    ``pipeline_forced_blessings_total``. Every label combination is created at start, so dashboards
    show zeros instead of nothing."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.runs = metrics.counter("pipeline_runs_total", "Pipeline runs ended, by final state.", ("state",))
        self.steps = metrics.counter("pipeline_steps_total", "Pipeline steps ended: ran, cached (outputs reused), "
                                     "failed or skipped.", ("kind", "outcome"))
        self.step_seconds = metrics.histogram("pipeline_step_duration_seconds", "Duration of steps that ran "
                                              "(not cached).", ("kind",), buckets=STEP_BUCKETS)
        self.triggers = metrics.counter("pipeline_triggers_total", "Requests for a run: started one, coalesced "
                                        "into the next, or ignored.", ("source", "outcome"))
        self.active = metrics.gauge("pipeline_runs_active", "Pipeline runs going now.")
        self.forced = metrics.counter("pipeline_forced_blessings_total", "Blessings forced by an admin.")
        for state in ("succeeded", "failed"):
            self.runs.labels(state)
        for kind in ("ingest", "validate", "train", "evaluate", "bless", "push"):
            self.step_seconds.labels(kind)
            for outcome in STEP_OUTCOMES:
                self.steps.labels(kind, outcome)
        for source in TRIGGER_SOURCES:
            for outcome in ("started", "coalesced", "ignored"):
                self.triggers.labels(source, outcome)
