"""Every Kafka topic of the platform, named and versioned in one place.

Topic names are ``opml.<family>.v<N>``; a breaking change of an event family gets a new topic.
``OPML_TOPIC_PREFIX`` is prepended at run time (tests use a unique prefix per run). Each topic
has a dead-letter companion ``<topic>.dlq`` for events its consumers could not handle.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topic:
    name: str
    partitions: int = 4
    description: str = ""

    def full_name(self, prefix: str = "") -> str:
        return prefix + self.name

    def dead_letter(self, prefix: str = "") -> str:
        return prefix + self.name + ".dlq"


BUNDLES = Topic("opml.bundles.v1", 4, "bundle committed / pushed / deleted (bundle-store)")
JOBS = Topic("opml.jobs.v1", 4, "job lifecycle: submitted, scheduled, started, preempted, resumed, retrying, "
             "succeeded, failed, cancelled (job-orchestrator)")
TRACES = Topic("opml.traces.v1", 4, "batches of always-on step metrics and capture announcements from traced "
               "jobs (trace-collector's injection)")
PREDICTIONS = Topic("opml.predictions.v1", 4, "every prediction served: inputs, outputs, model, version, "
                    "latency, request id (inference-router)")
DEPLOYMENTS = Topic("opml.deployments.v1", 4, "model deployed / failed / promoted / rolled back / placement "
                    "changed (inference-router)")

ALL_TOPICS: tuple[Topic, ...] = (BUNDLES, JOBS, TRACES, PREDICTIONS, DEPLOYMENTS)
