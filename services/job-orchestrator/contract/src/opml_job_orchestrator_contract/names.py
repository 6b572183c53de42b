"""The job-orchestrator's name on the platform and the CloudEvents source of every event it publishes.

Consumers that accept only the job-orchestrator's events (``EventConsumer(sources=...)``) name
:data:`EVENT_SOURCE` from here, never a copy of the string."""

from opml_common.events import event_source_of

SERVICE = "job-orchestrator"
EVENT_SOURCE = event_source_of(SERVICE)


def job_name(job_id: str) -> str:
    """The resource name of job ``job_id`` (``jobs/<id>``), as the API's requests take it."""
    return f"jobs/{job_id}"


def pipeline_name(pipeline: str) -> str:
    """The resource name of a pipeline (``pipelines/<name>``)."""
    return f"pipelines/{pipeline}"


def run_name(pipeline: str, run: int) -> str:
    """The resource name of run ``run`` of a pipeline (``pipelines/<name>/runs/<run>``)."""
    return f"pipelines/{pipeline}/runs/{run}"
