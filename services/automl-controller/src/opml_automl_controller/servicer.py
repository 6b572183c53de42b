"""The ExperimentService gRPC servicer: parses requests, calls the controller, converts the answers.

It holds no experiment logic (the :class:`~opml_automl_controller.controller.Controller`'s, which
imports no grpc) and publishes no events (the controller does, where each change happens).
"""

from __future__ import annotations

import re

from opml.automl.v1 import automl_pb2 as pb
from opml.automl.v1 import automl_pb2_grpc

from opml_automl_controller.controller import Controller
from opml_automl_controller.convert import experiment_to_proto, trial_to_proto
from opml_automl_controller.state import ExperimentRecord
from opml_common.errors import InvalidArgument
from opml_common.pagination import paginate

# The role each RPC needs (every RPC is listed: the server checks this against the service at start-up).
METHOD_ROLES = {"GetExperiment": "reader", "ListExperiments": "reader", "ListTrials": "reader",
                "ValidateExperiment": "reader", "CreateExperiment": "writer", "StopExperiment": "writer",
                "ResumeExperiment": "writer", "DeleteExperiment": "admin"}

_NAME = re.compile(r"^experiments/([^/]+)$")


def parse_experiment_name(field: str, name: str) -> str:
    match = _NAME.match(name)
    if not match:
        raise InvalidArgument(field, f"must look like experiments/{{experiment}}, but got {name[:100]!r}")
    return match.group(1)


class ExperimentServicer(automl_pb2_grpc.ExperimentServiceServicer):
    def __init__(self, controller: Controller) -> None:
        self._controller = controller

    async def CreateExperiment(self, request: pb.CreateExperimentRequest, context) -> pb.Experiment:
        view = await self._controller.create(request.katib_yaml)
        created = experiment_to_proto(view.record, view.spec, view.trials)
        created.warnings.extend(view.warnings)
        return created

    async def ValidateExperiment(self, request: pb.ValidateExperimentRequest, context
                                 ) -> pb.ValidateExperimentResponse:
        checked = self._controller.validate(request.katib_yaml)
        spec = checked.spec
        record = ExperimentRecord(name=spec.name, uid="", katib_yaml=request.katib_yaml,
                                  max_trial_count=spec.max_trial_count, reason="Validated")
        experiment = experiment_to_proto(record, spec, ())
        experiment.ClearField("status")
        return pb.ValidateExperimentResponse(experiment=experiment, notes=list(checked.notes), warnings=list(checked.warnings),
                                             trial_job=checked.trial_job.spec if checked.trial_job else None)

    async def GetExperiment(self, request: pb.GetExperimentRequest, context) -> pb.Experiment:
        view = await self._controller.get(parse_experiment_name("name", request.name))
        return experiment_to_proto(view.record, view.spec, view.trials)

    async def ListExperiments(self, request: pb.ListExperimentsRequest, context) -> pb.ListExperimentsResponse:
        views = await self._controller.list()
        page, token = paginate(views, request.page_size, request.page_token)
        return pb.ListExperimentsResponse(
            experiments=[experiment_to_proto(v.record, v.spec, v.trials, with_yaml=False) for v in page],
            next_page_token=token)

    async def DeleteExperiment(self, request: pb.DeleteExperimentRequest, context) -> pb.DeleteExperimentResponse:
        await self._controller.delete(parse_experiment_name("name", request.name))
        return pb.DeleteExperimentResponse()

    async def ListTrials(self, request: pb.ListTrialsRequest, context) -> pb.ListTrialsResponse:
        name = parse_experiment_name("parent", request.parent)
        trials = await self._controller.trials(name)
        page, token = paginate(trials, request.page_size, request.page_token, query=name)
        return pb.ListTrialsResponse(trials=[trial_to_proto(t) for t in page], next_page_token=token)

    async def StopExperiment(self, request: pb.StopExperimentRequest, context) -> pb.Experiment:
        view = await self._controller.stop_experiment(parse_experiment_name("name", request.name))
        return experiment_to_proto(view.record, view.spec, view.trials)

    async def ResumeExperiment(self, request: pb.ResumeExperimentRequest, context) -> pb.Experiment:
        view = await self._controller.resume(parse_experiment_name("name", request.name), request.max_trial_count)
        return experiment_to_proto(view.record, view.spec, view.trials)
