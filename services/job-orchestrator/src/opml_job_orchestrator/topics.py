"""The topics job-orchestrator consumes: committed spans (opml.bundles.v1) and alerts (opml.alerts.v1)
start pipeline runs (:mod:`opml_job_orchestrator.pipelines.triggers`)."""

from opml_bundle_store_contract.topics import BUNDLES
from opml_monitoring_scorer_contract.topics import ALERTS

__all__ = ["ALERTS", "BUNDLES"]
