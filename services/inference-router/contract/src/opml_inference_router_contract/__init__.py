"""The inference-router's contract: what other services and users need to deploy models on it and to
read what it publishes.

Its DeploymentService client, the topics it publishes (predictions, deployment events) with its event
source, how its prediction events are made (:mod:`.predictions`), and the model config a bundle
carries (:mod:`.model_config`: ``model.yaml``, which whoever produces a model writes and can validate
here). Inference itself goes through any KServe v2 client at the router's address.
"""

from opml_inference_router_contract.client import DeploymentClient, serving_config
from opml_inference_router_contract.model_config import ModelConfig, load_model_config
from opml_inference_router_contract.names import EVENT_SOURCE, SERVICE
from opml_inference_router_contract.predictions import (
    RECORD_CAP_BYTES,
    prediction_made,
    prediction_subject,
    tensor_summaries,
)
from opml_inference_router_contract.topics import DEPLOYMENTS, PREDICTIONS

__all__ = ["DEPLOYMENTS", "EVENT_SOURCE", "PREDICTIONS", "RECORD_CAP_BYTES", "SERVICE", "DeploymentClient",
           "ModelConfig", "load_model_config", "prediction_made", "prediction_subject", "serving_config",
           "tensor_summaries"]
