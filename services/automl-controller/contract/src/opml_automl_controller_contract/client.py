"""Python client of the automl-controller API, used by the CLI.

Failed calls raise the platform's domain errors (``NotFound``, ``InvalidArgument``...), never a
bare ``grpc.RpcError``.
"""

from __future__ import annotations

from opml.automl.v1 import automl_pb2 as pb
from opml.automl.v1 import automl_pb2_grpc

from opml_automl_controller_contract.names import experiment_name
from opml_common.grpc.client import ServiceClient, pages


class ExperimentClient(ServiceClient):
    stub_class = automl_pb2_grpc.ExperimentServiceStub

    def create(self, katib_yaml: str) -> pb.Experiment:
        return self.stub.CreateExperiment(pb.CreateExperimentRequest(katib_yaml=katib_yaml))

    def validate(self, katib_yaml: str) -> pb.ValidateExperimentResponse:
        return self.stub.ValidateExperiment(pb.ValidateExperimentRequest(katib_yaml=katib_yaml))

    def get(self, name: str) -> pb.Experiment:
        return self.stub.GetExperiment(pb.GetExperimentRequest(name=experiment_name(name)))

    def list(self) -> list[pb.Experiment]:
        return list(pages(lambda token: self.stub.ListExperiments(pb.ListExperimentsRequest(page_token=token)),
                          lambda reply: reply.experiments))

    def trials(self, name: str) -> list[pb.Trial]:
        return list(pages(lambda token: self.stub.ListTrials(
            pb.ListTrialsRequest(parent=experiment_name(name), page_token=token)), lambda reply: reply.trials))

    def stop(self, name: str) -> pb.Experiment:
        return self.stub.StopExperiment(pb.StopExperimentRequest(name=experiment_name(name)))

    def resume(self, name: str, max_trial_count: int = 0) -> pb.Experiment:
        return self.stub.ResumeExperiment(pb.ResumeExperimentRequest(name=experiment_name(name),
                                                                     max_trial_count=max_trial_count))

    def delete(self, name: str) -> None:
        self.stub.DeleteExperiment(pb.DeleteExperimentRequest(name=experiment_name(name)))
