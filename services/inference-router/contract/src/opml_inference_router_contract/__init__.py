"""The inference-router's contract: what other services and users need to deploy models on it and to
read what it publishes.

Its DeploymentService client, the topics it publishes (predictions, deployment events) with its event
source, how its prediction events are made (:mod:`.predictions`), and the model config a bundle
carries (:mod:`.model_config`: ``model.yaml``, which whoever produces a model writes and can validate
here) with its rollout spec (:mod:`.rollout_spec`: ``rollout.yaml``). Inference itself goes through
any KServe v2 client at the router's address.
"""

from opml_common.lazy import lazy_exports

# Imported on first use: a core or a traced job that needs only names or topics stays free of the
# client's grpc (and whatever else a submodule needs).
_EXPORTS = {
    "DEPLOYMENTS": "topics",
    "DeploymentClient": "client",
    "EVENT_SOURCE": "names",
    "ModelConfig": "model_config",
    "PREDICTIONS": "topics",
    "RECORD_CAP_BYTES": "predictions",
    "RolloutSpec": "rollout_spec",
    "SERVICE": "names",
    "load_model_config": "model_config",
    "load_rollout_spec": "rollout_spec",
    "prediction_made": "predictions",
    "prediction_subject": "predictions",
    "serving_config": "client",
    "tensor_summaries": "predictions",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
