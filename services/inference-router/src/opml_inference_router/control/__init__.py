"""The router's control plane: worker pools, deployments from bundles, placement, autodeploy.

:class:`PoolManager` runs the workers; :class:`DeploymentManager` deploys model versions onto them
with the placement core (:mod:`opml_inference_router.placement`) and drives the
:class:`~opml_inference_router.routing.Router`; :mod:`.autodeploy` deploys committed bundles
tagged ``serve=true`` from the bundles topic; :class:`ServingModels` measures and predicts serving
configurations (a surrogate objective for experiments).
"""

from opml_inference_router.control.deployments import DeploymentManager
from opml_inference_router.control.observe import Observer
from opml_inference_router.control.pools import PoolManager
from opml_inference_router.control.serving_models import ServingModels
from opml_inference_router.control.state import DeploymentStore, ModelRecord, Source, VersionRecord

__all__ = ["DeploymentManager", "DeploymentStore", "ModelRecord", "Observer", "PoolManager", "ServingModels",
           "Source", "VersionRecord"]
