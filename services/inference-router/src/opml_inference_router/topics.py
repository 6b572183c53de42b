"""The topics inference-router consumes (bundles: it deploys committed bundles tagged to serve); those it
publishes are its contract's (:mod:`opml_inference_router_contract.topics`)."""

from opml_bundle_store_contract.topics import BUNDLES

__all__ = ["BUNDLES"]
