"""Python client of the router's DeploymentService, used by the CLI and by other services.

Failed calls raise the platform's domain errors (``NotFound``, ``InvalidArgument``...), never a
bare ``grpc.RpcError``. Inference goes through any KServe v2 client (tritonclient) at the same address.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from opml.inference.v1 import deployments_pb2 as pb
from opml.inference.v1 import deployments_pb2_grpc

from opml_common.grpc.client import ServiceClient, pages
from opml_common.perfmodel import ServingConfig

DEPLOY_TIMEOUT_S = 600.0  # a deploy fetches, profiles on every allowed kind and loads the replicas
CALL_TIMEOUT_S = 60.0


class DeploymentClient(ServiceClient):
    stub_class = deployments_pb2_grpc.DeploymentServiceStub

    def deploy(self, *, bundle: str = "", context: str = "", model_dir: str = "", version: int = 0,
               canary_percent: float = 0.0) -> pb.Deployment:
        """Deploy a bundle (``context`` + name or UUID) or a ``model_dir``; returns once it serves."""
        request = pb.DeployRequest(version=version, canary_percent=canary_percent)
        if bundle:
            request.bundle.CopyFrom(pb.BundleRef(context=context, bundle=bundle))
        elif model_dir:
            request.model_dir = model_dir
        return self.stub.Deploy(request, timeout=DEPLOY_TIMEOUT_S)

    def undeploy(self, model: str) -> None:
        self.stub.Undeploy(pb.UndeployRequest(name=f"models/{model}"), timeout=CALL_TIMEOUT_S)

    def list(self) -> list[pb.Deployment]:
        return list(pages(lambda token: self.stub.ListDeployments(pb.ListDeploymentsRequest(page_token=token),
                                                                  timeout=CALL_TIMEOUT_S),
                          lambda reply: reply.deployments))

    def get(self, model: str) -> pb.Deployment:
        return self.stub.GetDeployment(pb.GetDeploymentRequest(name=f"models/{model}"), timeout=CALL_TIMEOUT_S)

    def set_traffic(self, model: str, weights: Mapping[str, float]) -> pb.Deployment:
        return self.stub.SetTraffic(pb.SetTrafficRequest(name=f"models/{model}", weights=dict(weights)),
                                    timeout=CALL_TIMEOUT_S)

    def promote(self, model: str, version: int = 0) -> pb.Deployment:
        return self.stub.Promote(pb.PromoteRequest(name=f"models/{model}", version=version),
                                 timeout=DEPLOY_TIMEOUT_S)

    def rollback(self, model: str) -> pb.Deployment:
        return self.stub.Rollback(pb.RollbackRequest(name=f"models/{model}"), timeout=DEPLOY_TIMEOUT_S)

    def get_rollout(self, model: str) -> pb.Rollout:
        return self.stub.GetRollout(pb.GetRolloutRequest(name=f"models/{model}"), timeout=CALL_TIMEOUT_S)

    def abort_rollout(self, model: str) -> pb.Rollout:
        """All traffic back to the stable version; the rollout's version is retired (admin role)."""
        return self.stub.AbortRollout(pb.AbortRolloutRequest(name=f"models/{model}"), timeout=DEPLOY_TIMEOUT_S)

    def resume_rollout(self, model: str, *, skip_analysis: bool = False) -> pb.Rollout:
        """Continue a paused rollout, past the analysis it is at with ``skip_analysis`` (admin role)."""
        return self.stub.ResumeRollout(pb.ResumeRolloutRequest(name=f"models/{model}", skip_analysis=skip_analysis),
                                       timeout=CALL_TIMEOUT_S)

    def placement(self) -> pb.Placement:
        return self.stub.GetPlacement(pb.GetPlacementRequest(), timeout=CALL_TIMEOUT_S)

    def measure_serving_configs(self, name: str, pool_kind: str, configs: Sequence[ServingConfig], *,
                                runs: int = 0, passes: int = 0) -> pb.ServingMeasurements:
        """Measure ``configs`` of ``name`` (models/{model}/versions/{version}) on ``pool_kind``; every
        measurement kept for it there comes back."""
        request = pb.MeasureServingConfigsRequest(name=name, pool_kind=pool_kind, runs=runs, passes=passes,
                                                  configs=[serving_config(c) for c in configs])
        return self.stub.MeasureServingConfigs(request, timeout=DEPLOY_TIMEOUT_S)

    def predict_serving_performance(self, name: str, pool_kind: str,
                                    configs: Sequence[ServingConfig]) -> pb.ServingPerformance:
        """Predicted latency and throughput of ``configs``, and the performance model's fit."""
        request = pb.PredictServingPerformanceRequest(name=name, pool_kind=pool_kind,
                                                      configs=[serving_config(c) for c in configs])
        return self.stub.PredictServingPerformance(request, timeout=CALL_TIMEOUT_S)


def serving_config(config: ServingConfig) -> pb.ServingConfig:
    """The message of a configuration (the servicer's replies build theirs with it too)."""
    return pb.ServingConfig(batch=config.batch, threads=config.threads, opt_level=config.opt_level,
                            execution_mode=config.execution_mode, precision=config.precision)
