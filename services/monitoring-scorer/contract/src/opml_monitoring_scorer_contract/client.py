"""Python client of the monitoring-scorer API (the CLI's, and any service's). Failed calls raise the
platform's domain errors (``NotFound``, ``InvalidArgument``...), never a bare ``grpc.RpcError``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from opml.monitoring.v1 import monitoring_pb2 as pb
from opml.monitoring.v1 import monitoring_pb2_grpc

from opml_common.grpc.client import ServiceClient, pages
from opml_monitoring_scorer_contract.names import version_name


class MonitoringClient(ServiceClient):
    stub_class = monitoring_pb2_grpc.MonitoringServiceStub

    def register(self, model: str, version: str, context: str, bundle: str) -> pb.ModelStatus:
        return self.stub.RegisterModel(pb.RegisterModelRequest(
            model=model, version=version, reference=pb.BundleRef(context=context, bundle=bundle)))

    def status(self, model: str, version: str, *, segment: str = "") -> pb.ModelStatus:
        """The version's status, or one ``segment``'s of a version monitored per segment."""
        return self.stub.GetModelStatus(pb.GetModelStatusRequest(name=version_name(model, version), segment=segment))

    def list_models(self) -> list[pb.ModelStatus]:
        return list(self.stub.ListModels(pb.ListModelsRequest()).models)

    def windows(self, model: str, version: str, *, page_size: int = 0, segment: str = "",
                include_open: bool = False) -> Iterator[pb.Window]:
        """Every window of the version (or of its ``segment``), newest first, page by page;
        ``include_open``: first the open window's truth so far (``Window.open``), when labels joined it."""
        name = version_name(model, version)
        return pages(lambda token: self.stub.ListWindows(pb.ListWindowsRequest(
            name=name, page_size=page_size, page_token=token, segment=segment, include_open=include_open)),
            lambda reply: reply.windows)

    def alerts(self, model: str = "", version: str = "", *, segment: str = "") -> list[pb.Alert]:
        """The alerts of the version (every version's when ``model`` is empty), or of its ``segment``'s rules."""
        name = version_name(model, version) if model else ""
        return list(pages(lambda token: self.stub.ListAlerts(pb.ListAlertsRequest(name=name, page_token=token,
                                                                                  segment=segment)),
                          lambda reply: reply.alerts))

    def get_rules(self, model: str, version: str) -> pb.Rules:
        return self.stub.GetRules(pb.GetRulesRequest(name=version_name(model, version)))

    def set_rules(self, model: str, version: str, text: str) -> pb.Rules:
        return self.stub.SetRules(pb.SetRulesRequest(name=version_name(model, version), yaml=text))

    def submit_labels(self, model: str, labels: Iterable[tuple[str, list[float], float | None]], *,
                      version: str = "") -> int:
        """Publishes (request id, values, time in epoch seconds or None: now) labels, at most 1000 a call;
        returns how many were published."""
        rows = []
        for request_id, values, time in labels:
            row = pb.SubmittedLabel(request_id=request_id, values=values)
            if time is not None:
                row.time.FromNanoseconds(int(time * 1e9))
            rows.append(row)
        return self.stub.SubmitLabels(pb.SubmitLabelsRequest(model=model, version=version, labels=rows)).published
