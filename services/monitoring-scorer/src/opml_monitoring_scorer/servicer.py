"""The MonitoringService gRPC servicer: parses requests, calls the scorer, converts the answers.
It holds no scoring logic and publishes no events (those come from core/scorer.py)."""

from __future__ import annotations

import yaml
from opml.monitoring.v1 import monitoring_pb2 as pb
from opml.monitoring.v1 import monitoring_pb2_grpc

from opml_common.errors import InvalidArgument
from opml_common.pagination import cursor_token, page_size_of, read_cursor
from opml_monitoring_scorer.convert import alert_to_proto, parse_name, status_to_proto, window_to_proto
from opml_monitoring_scorer.core.records import AlertRecord
from opml_monitoring_scorer.core.scorer import Monitored, Scorer, SubmittedLabel
from opml_monitoring_scorer.core.segments import MAX_SEGMENT_CHARS, window_key
from opml_monitoring_scorer_contract.names import version_name

METHOD_ROLES = {"RegisterModel": "writer", "GetModelStatus": "reader", "ListModels": "reader",
                "ListWindows": "reader", "ListAlerts": "reader", "GetRules": "reader", "SetRules": "writer",
                "SubmitLabels": "writer"}
MAX_WINDOWS_PAGE = 1000
MAX_ALERTS_PAGE = 1000
AlertPlace = tuple[int, str, str, str]
"""An alert's place in ListAlerts: (-raised at window, model, version, rule)."""
_PLACE_TYPES = (int, str, str, str)


def _check_segment(monitored: Monitored, segment: str) -> None:
    """Raises: InvalidArgument: ``segment`` is set but the version is not monitored per segment, or too long."""
    problems = []
    if segment and not monitored.config.segment_parameter:
        problems.append(("segment", f"{monitored.key} is not monitored per segment (its monitoring.yaml sets no "
                                    "segment.parameter); leave it empty for the version as a whole"))
    if len(segment) > MAX_SEGMENT_CHARS:
        problems.append(("segment", f"must hold at most {MAX_SEGMENT_CHARS} characters"))
    if problems:
        raise InvalidArgument.of(problems)


def _alert_order(alert: AlertRecord) -> AlertPlace:
    return -alert.raised_at_window, alert.model, alert.version, alert.rule


class MonitoringServicer(monitoring_pb2_grpc.MonitoringServiceServicer):
    def __init__(self, scorer: Scorer) -> None:
        self._scorer = scorer

    async def _status(self, key: str, segment: str = "") -> pb.ModelStatus:
        """The version's status, or its ``segment``'s (its windows, predictions and alerts)."""
        monitored = await self._scorer.find(key)
        _check_segment(monitored, segment)
        store, wk = self._scorer.store, window_key(key, segment)
        last = await store.windows(wk, before=None, limit=1)
        segments = await store.segments(key) if monitored.config.segment_parameter else []
        return status_to_proto(monitored, windows=await store.window_count(wk), predictions=await store.total_rows(wk),
                               last=last[0] if last else None, firing=await store.firing(wk), segment=segment,
                               segments=segments)

    async def RegisterModel(self, request: pb.RegisterModelRequest, context) -> pb.ModelStatus:
        monitored = await self._scorer.register(request.model, request.version, request.reference.context,
                                                request.reference.bundle)
        return await self._status(monitored.key)

    async def GetModelStatus(self, request: pb.GetModelStatusRequest, context) -> pb.ModelStatus:
        return await self._status(parse_name("name", request.name), request.segment)

    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[await self._status(key) for key in sorted(self._scorer.models)])

    async def ListWindows(self, request: pb.ListWindowsRequest, context) -> pb.ListWindowsResponse:
        key = parse_name("name", request.name)
        _check_segment(await self._scorer.find(key), request.segment)
        if request.page_size < 0:
            raise InvalidArgument("page_size", f"must be >= 0, but got {request.page_size}")
        size = min(request.page_size or 50, MAX_WINDOWS_PAGE)
        before = None
        if request.page_token:
            try:
                before = int(request.page_token)
            except ValueError:
                raise InvalidArgument("page_token", "is not a token this API gave") from None
        wk = window_key(key, request.segment)
        records = await self._scorer.store.windows(wk, before=before, limit=size + 1)
        page, more = records[:size], len(records) > size
        windows = [window_to_proto(r) for r in page]
        if request.include_open and before is None:
            opened = await self._open_window(wk, records[0] if records else None, request.segment)
            if opened is not None:
                windows.insert(0, opened)
        return pb.ListWindowsResponse(windows=windows, next_page_token=str(page[-1]["index"]) if more else "")

    async def _open_window(self, wk: str, newest: dict | None, segment: str) -> pb.Window | None:
        """The open window (the one after the newest saved) with the truth of the labels joined to it so
        far (Redis ``truth:{wk}:{window}``, which the window reads when it closes); None before any: a
        rollout's accuracy check counts labels as they join, not once 1,000 predictions close it."""
        index = newest["index"] + 1 if newest is not None else 0
        labelled, total = await self._scorer.store.truth(wk, index)
        if not labelled:
            return None
        window = pb.Window(index=index, labelled=labelled, true_value=total / labelled, segment=segment, open=True)
        if newest is not None and newest.get("last_time") is not None:
            window.first_time.FromNanoseconds(int(newest["last_time"] * 1e9))
        return window

    async def ListAlerts(self, request: pb.ListAlertsRequest, context) -> pb.ListAlertsResponse:
        """Newest first, a page at a time from where the last ended (its token holds the last alert's
        place, not an offset: every alert is reached, however many a version raised)."""
        keys = [parse_name("name", request.name)] if request.name else sorted(self._scorer.models)
        size = page_size_of(request.page_size, max_size=MAX_ALERTS_PAGE)
        scope = window_key(request.name, request.segment)  # a token serves the listing it came from
        after = read_cursor(request.page_token, _PLACE_TYPES, scope) if request.page_token else None
        store, alerts = self._scorer.store, []
        if len(request.segment) > MAX_SEGMENT_CHARS:
            raise InvalidArgument("segment", f"must hold at most {MAX_SEGMENT_CHARS} characters")
        for key in keys:
            monitored = await self._scorer.find(key)
            if request.name:
                _check_segment(monitored, request.segment)
            elif request.segment and not monitored.config.segment_parameter:
                continue
            wk = window_key(key, request.segment)
            if after is not None:
                alerts += [a for a in await store.alerts_at(wk, -after[0]) if _alert_order(a) > after]
            alerts += await store.alerts(wk, below=None if after is None else -after[0], limit=size + 1)
        alerts.sort(key=_alert_order)
        page = alerts[:size]
        token = cursor_token(_alert_order(page[-1]), scope) if len(alerts) > size else ""
        return pb.ListAlertsResponse(alerts=[alert_to_proto(a) for a in page], next_page_token=token)

    async def GetRules(self, request: pb.GetRulesRequest, context) -> pb.Rules:
        key = parse_name("name", request.name)
        monitored = await self._scorer.find(key)
        text = yaml.safe_dump({"rules": [r.to_dict() for r in monitored.rules]}, sort_keys=False)
        return pb.Rules(name=version_name(monitored.model, monitored.version), yaml=text)

    async def SetRules(self, request: pb.SetRulesRequest, context) -> pb.Rules:
        key = parse_name("name", request.name)
        await self._scorer.set_rules(key, request.yaml)
        return await self.GetRules(pb.GetRulesRequest(name=request.name), context)

    async def SubmitLabels(self, request: pb.SubmitLabelsRequest, context) -> pb.SubmitLabelsResponse:
        labels = [SubmittedLabel(row.request_id, tuple(row.values),
                                 row.time.ToNanoseconds() / 1e9 if row.HasField("time") else None)
                  for row in request.labels]
        return pb.SubmitLabelsResponse(published=await self._scorer.submit_labels(request.model, request.version,
                                                                                 labels))
