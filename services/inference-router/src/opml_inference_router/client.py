"""Python client of the router's DeploymentService, used by the CLI and by other services.

Failed calls raise the platform's domain errors (``NotFound``, ``InvalidArgument``...), never a
bare ``grpc.RpcError``. Inference goes through any KServe v2 client (tritonclient) at the same address.
"""

from __future__ import annotations

from collections.abc import Mapping

from opml.inference.v1 import deployments_pb2 as pb
from opml.inference.v1 import deployments_pb2_grpc
from opml_common.grpc.client import open_channel, raising_domain_errors

DEPLOY_TIMEOUT_S = 600.0  # a deploy fetches, profiles on every allowed kind and loads the replicas
CALL_TIMEOUT_S = 60.0


class DeploymentClient:
    def __init__(self, target: str, *, token: str | None = None) -> None:
        self._channel = open_channel(target, token=token)
        self._stub = deployments_pb2_grpc.DeploymentServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> DeploymentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @raising_domain_errors
    def deploy(self, *, bundle: str = "", context: str = "", model_dir: str = "", version: int = 0,
               canary_percent: float = 0.0) -> pb.Deployment:
        """Deploy a bundle (``context`` + name or UUID) or a ``model_dir``; returns once it serves."""
        request = pb.DeployRequest(version=version, canary_percent=canary_percent)
        if bundle:
            request.bundle.CopyFrom(pb.BundleRef(context=context, bundle=bundle))
        elif model_dir:
            request.model_dir = model_dir
        return self._stub.Deploy(request, timeout=DEPLOY_TIMEOUT_S)

    @raising_domain_errors
    def undeploy(self, model: str) -> None:
        self._stub.Undeploy(pb.UndeployRequest(name=f"models/{model}"), timeout=CALL_TIMEOUT_S)

    @raising_domain_errors
    def list(self) -> list[pb.Deployment]:
        deployments, token = [], ""
        while True:
            reply = self._stub.ListDeployments(pb.ListDeploymentsRequest(page_token=token), timeout=CALL_TIMEOUT_S)
            deployments.extend(reply.deployments)
            if not (token := reply.next_page_token):
                return deployments

    @raising_domain_errors
    def get(self, model: str) -> pb.Deployment:
        return self._stub.GetDeployment(pb.GetDeploymentRequest(name=f"models/{model}"), timeout=CALL_TIMEOUT_S)

    @raising_domain_errors
    def set_traffic(self, model: str, weights: Mapping[str, float]) -> pb.Deployment:
        return self._stub.SetTraffic(pb.SetTrafficRequest(name=f"models/{model}", weights=dict(weights)),
                                     timeout=CALL_TIMEOUT_S)

    @raising_domain_errors
    def promote(self, model: str, version: int = 0) -> pb.Deployment:
        return self._stub.Promote(pb.PromoteRequest(name=f"models/{model}", version=version),
                                  timeout=DEPLOY_TIMEOUT_S)

    @raising_domain_errors
    def rollback(self, model: str) -> pb.Deployment:
        return self._stub.Rollback(pb.RollbackRequest(name=f"models/{model}"), timeout=DEPLOY_TIMEOUT_S)

    @raising_domain_errors
    def placement(self) -> pb.Placement:
        return self._stub.GetPlacement(pb.GetPlacementRequest(), timeout=CALL_TIMEOUT_S)
