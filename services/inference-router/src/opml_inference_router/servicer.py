"""The DeploymentService gRPC servicer: parses requests, calls the DeploymentManager, converts replies.

Domain errors raised by the manager become status codes in the shared interceptor. Roles: reads
need ``reader``; deploying, traffic changes, promote and rollback need ``writer`` (what a person who
ships models does every day, like adding bundles); so does ``MeasureServingConfigs`` (it takes the
machine's cores for seconds), while ``PredictServingPerformance`` reads; ``Undeploy`` removes a
model from serving altogether and needs ``admin`` (DESIGN: deletion is an admin API). ``GetRollout``
reads; ``AbortRollout`` and ``ResumeRollout`` override what a rollout's analyses decided (or skip them)
and need ``admin``.
"""

from __future__ import annotations

import math
import re

from opml.inference.v1 import deployments_pb2 as pb
from opml.inference.v1 import deployments_pb2_grpc

from opml_common.errors import FailedPrecondition, InvalidArgument
from opml_common.grpc.server import ServiceRegistration
from opml_common.pagination import paginate
from opml_inference_router.control import DeploymentManager, ServingModels, Source, convert
from opml_inference_router.control.progressive import ProgressiveRollouts, rollout_message
from opml_inference_router_contract.model_config import version_number

SERVICE = pb.DESCRIPTOR.services_by_name["DeploymentService"]
METHOD_ROLES = {
    "ListDeployments": "reader", "GetDeployment": "reader", "GetPlacement": "reader",
    "PredictServingPerformance": "reader", "MeasureServingConfigs": "writer", "Deploy": "writer", "SetTraffic": "writer", "Promote": "writer", "Rollback": "writer",
    "Undeploy": "admin", "GetRollout": "reader", "AbortRollout": "admin", "ResumeRollout": "admin",
}
_MODEL_NAME = re.compile(r"^models/([^/]+)$")
_VERSION_NAME = re.compile(r"^models/([^/]+)/versions/([1-9][0-9]*)$")
MAX_MEASURED_CONFIGS = 512
MAX_PREDICTED_CONFIGS = 1000
MAX_RUNS, MAX_PASSES = 100, 5


def parse_model_name(name: str) -> str:
    match = _MODEL_NAME.match(name)
    if not match:
        raise InvalidArgument("name", f"must look like models/{{model}}, but got {name!r}")
    return match.group(1)


def parse_version_name(name: str) -> tuple[str, int]:
    match = _VERSION_NAME.match(name)
    if not match:
        raise InvalidArgument("name", f"must look like models/{{model}}/versions/{{version}} (version >= 1), "
                                      f"but got {name!r}")
    return match.group(1), int(match.group(2))


def _pool_kind(kind: str) -> str:
    if not kind:
        raise InvalidArgument("pool_kind", "is required: the pool kind to measure or predict on")
    return kind


class DeploymentServicer(deployments_pb2_grpc.DeploymentServiceServicer):
    """``allow_model_dir``: accept deploys from a directory on the router's machine (development
    only: in production a caller must not make the router read arbitrary paths)."""

    def __init__(self, manager: DeploymentManager, *, allow_model_dir: bool = True,
                 serving_models: ServingModels | None = None, rollouts: ProgressiveRollouts | None = None) -> None:
        self._manager = manager
        self._rollouts = rollouts
        self._serving_models = serving_models or ServingModels(models=manager.models, fleet=manager.fleet)
        self._allow_model_dir = allow_model_dir

    def registration(self) -> ServiceRegistration:
        return ServiceRegistration(SERVICE, deployments_pb2_grpc.add_DeploymentServiceServicer_to_server, self,
                                   METHOD_ROLES)

    async def Deploy(self, request: pb.DeployRequest, context) -> pb.Deployment:
        which = request.WhichOneof("source")
        if which == "bundle":
            if not request.bundle.context or not request.bundle.bundle:
                raise InvalidArgument("bundle", "must name a context and a bundle (name or UUID), "
                                                f"but got context={request.bundle.context!r} "
                                                f"bundle={request.bundle.bundle!r}")
            source = Source(context=request.bundle.context, bundle=request.bundle.bundle)
        elif which == "model_dir" and request.model_dir:
            if not self._allow_model_dir:
                raise FailedPrecondition("model_dir deploys are for development (OPML_ENV=dev); deploy a bundle")
            source = Source(model_dir=request.model_dir)
        else:
            raise InvalidArgument("source", "set bundle (context and name or UUID) or model_dir")
        if not math.isfinite(request.canary_percent):
            raise InvalidArgument("canary_percent", f"must be in [0, 100), but got {request.canary_percent}")
        record = await self._manager.deploy(source, version=request.version, canary_percent=request.canary_percent)
        return convert.deployment(self._manager, record)

    async def Undeploy(self, request: pb.UndeployRequest, context) -> pb.UndeployResponse:
        await self._manager.undeploy(parse_model_name(request.name))
        return pb.UndeployResponse()

    async def ListDeployments(self, request: pb.ListDeploymentsRequest, context) -> pb.ListDeploymentsResponse:
        names = sorted(self._manager.models)
        page, token = paginate(names, request.page_size, request.page_token)
        return pb.ListDeploymentsResponse(
            deployments=[convert.deployment(self._manager, self._manager.record(name)) for name in page],
            next_page_token=token)

    async def GetDeployment(self, request: pb.GetDeploymentRequest, context) -> pb.Deployment:
        return convert.deployment(self._manager, self._manager.record(parse_model_name(request.name)))

    async def SetTraffic(self, request: pb.SetTrafficRequest, context) -> pb.Deployment:
        name = parse_model_name(request.name)
        if not request.weights:
            raise InvalidArgument("weights", "must give at least one version a weight, e.g. {'2': 1}")
        weights: dict[str, float] = {}
        for version, weight in request.weights.items():
            number = version_number(version)
            if number is None:
                raise InvalidArgument(f"weights[{version[:40]}]", "keys must be version numbers >= 1")
            if not math.isfinite(weight) or weight < 0:
                raise InvalidArgument(f"weights[{version}]", f"must be a finite weight >= 0, but got {weight}")
            weights[str(number)] = weight
        record = await self._manager.set_traffic(name, weights)
        return convert.deployment(self._manager, record)

    async def Promote(self, request: pb.PromoteRequest, context) -> pb.Deployment:
        if request.version < 0:
            raise InvalidArgument("version", f"must be >= 1, or 0 for the canary, but got {request.version}")
        record = await self._manager.promote(parse_model_name(request.name), request.version)
        return convert.deployment(self._manager, record)

    async def Rollback(self, request: pb.RollbackRequest, context) -> pb.Deployment:
        record = await self._manager.rollback(parse_model_name(request.name))
        return convert.deployment(self._manager, record)

    async def GetPlacement(self, request: pb.GetPlacementRequest, context) -> pb.Placement:
        return convert.placement(self._manager)

    async def MeasureServingConfigs(self, request: pb.MeasureServingConfigsRequest,
                                    context) -> pb.ServingMeasurements:
        model, version = parse_version_name(request.name)
        kind = _pool_kind(request.pool_kind)
        configs = convert.serving_configs(request.configs, most=MAX_MEASURED_CONFIGS)
        for field, value, most in (("runs", request.runs, MAX_RUNS), ("passes", request.passes, MAX_PASSES)):
            if not 0 <= value <= most:
                raise InvalidArgument(field, f"must be in [1, {most}] (0: the default), but got {value}")
        samples = await self._serving_models.measure(model, version, kind, configs, runs=request.runs or 15,
                                                     passes=request.passes or 3)
        return convert.serving_measurements(request.name, kind, samples)

    async def PredictServingPerformance(self, request: pb.PredictServingPerformanceRequest,
                                        context) -> pb.ServingPerformance:
        model, version = parse_version_name(request.name)
        kind = _pool_kind(request.pool_kind)
        configs = convert.serving_configs(request.configs, most=MAX_PREDICTED_CONFIGS)
        predictions, fit = await self._serving_models.predict(model, version, kind, configs)
        return convert.serving_performance(request.name, kind, predictions, fit)

    async def GetRollout(self, request: pb.GetRolloutRequest, context) -> pb.Rollout:
        return rollout_message(self._progressive().get(parse_model_name(request.name)))

    async def AbortRollout(self, request: pb.AbortRolloutRequest, context) -> pb.Rollout:
        return rollout_message(await self._progressive().abort(parse_model_name(request.name)))

    async def ResumeRollout(self, request: pb.ResumeRolloutRequest, context) -> pb.Rollout:
        state = await self._progressive().resume(parse_model_name(request.name), skip_analysis=request.skip_analysis)
        return rollout_message(state)

    def _progressive(self) -> ProgressiveRollouts:
        if self._rollouts is None:
            raise FailedPrecondition("this router runs no progressive rollouts")
        return self._rollouts
