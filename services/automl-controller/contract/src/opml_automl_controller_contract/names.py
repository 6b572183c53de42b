"""The automl-controller's name on the platform and the CloudEvents source of every event it publishes.

Consumers that accept only the automl-controller's events (``EventConsumer(sources=...)``) name
:data:`EVENT_SOURCE` from here, never a copy of the string."""

from opml_common.events import event_source_of

SERVICE = "automl-controller"
EVENT_SOURCE = event_source_of(SERVICE)


def experiment_name(name: str) -> str:
    """The resource name of experiment ``name`` (``experiments/<name>``)."""
    return f"experiments/{name}"


def trial_name(experiment: str, number: int) -> str:
    """The resource name of trial ``number`` of ``experiment`` (``experiments/<name>/trials/<number>``)."""
    return f"experiments/{experiment}/trials/{number}"
