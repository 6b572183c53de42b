"""The topics inference-router consumes (bundles: it deploys committed bundles tagged to serve; quality:
the monitoring-scorer's windows its rollouts' quality checks judge); those it publishes are its
contract's (:mod:`opml_inference_router_contract.topics`)."""

from opml_bundle_store_contract.topics import BUNDLES
from opml_monitoring_scorer_contract.topics import QUALITY

__all__ = ["BUNDLES", "QUALITY"]
