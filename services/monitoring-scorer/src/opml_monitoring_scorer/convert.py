"""Conversions between the scorer's records and the monitoring protos (API replies)."""

from __future__ import annotations

import re
from typing import Any

from opml.monitoring.v1 import monitoring_pb2 as pb

from opml_common.errors import InvalidArgument
from opml_monitoring_scorer.core.records import AlertRecord
from opml_monitoring_scorer.core.scorer import Monitored
from opml_monitoring_scorer_contract.names import version_name

_NAME = re.compile(r"^models/([^/]+)/versions/([^/]+)$")


def parse_name(field: str, name: str) -> str:
    """``models/{model}/versions/{version}`` -> ``model/version``.

    Raises: InvalidArgument: ``field`` does not have that form."""
    match = _NAME.match(name)
    if not match or len(name) > 512:
        raise InvalidArgument(field, f"must look like models/{{model}}/versions/{{version}}, but got {name[:80]!r}")
    return f"{match.group(1)}/{match.group(2)}"


def _drift(data: dict[str, Any] | None) -> pb.FeatureDrift | None:
    if not data:
        return None
    return pb.FeatureDrift(feature=data["feature"], method=data["method"], statistic=data["statistic"],
                           threshold=data["threshold"], drifted=data["drifted"], distance=data["distance"])


def window_to_proto(record: dict[str, Any]) -> pb.Window:
    window = pb.Window(index=record["index"], rows=record["rows"], score=record["score"], parts=record["parts"],
                       labelled=record.get("labelled", 0), data_quality_share=record["data_quality_share"],
                       flags=record.get("flags", []), drift=[_drift(d) for d in record["drift"]],
                       segment=record.get("segment", ""))
    for field, key in (("mpp", "mpp"), ("cbpe", "cbpe"), ("true_value", "true")):
        if record.get(key) is not None:
            setattr(window, field, record[key])
    for field in ("output_drift", "confidence_drift"):
        drift = _drift(record.get(field))
        if drift is not None:
            getattr(window, field).CopyFrom(drift)
    if record.get("first_time") is not None:
        window.first_time.FromNanoseconds(int(record["first_time"] * 1e9))
        window.last_time.FromNanoseconds(int(record["last_time"] * 1e9))
    return window


def status_to_proto(monitored: Monitored, *, windows: int, predictions: int, last: dict[str, Any] | None,
                    firing: list[str], segment: str = "", segments: list[str] | None = None) -> pb.ModelStatus:
    """A segment's reference rows and performance are its own reference's once its first window closed."""
    monitor = monitored.segments.get(segment, monitored.monitor) if segment else monitored.monitor
    status = pb.ModelStatus(
        name=version_name(monitored.model, monitored.version),
        task=(monitor.task.value if monitor else (monitored.config.task.value if monitored.config.task else "")),
        reference=pb.BundleRef(context=monitored.context, bundle=monitored.bundle_uuid),
        reference_rows=len(monitor.reference) if monitor else 0,
        reference_performance=(monitor.reference_performance or 0.0) if monitor else 0.0,
        limitations=list(monitored.limitations), windows=windows, predictions=predictions, firing=firing,
        window_count=monitored.config.window.count or 0, window_seconds=monitored.config.window.seconds or 0.0,
        segment=segment, segment_parameter=monitored.config.segment_parameter or "", segments=segments or [])
    if last is not None:
        status.last_window.CopyFrom(window_to_proto(last))
    return status


def alert_to_proto(alert: AlertRecord) -> pb.Alert:
    return pb.Alert(name=version_name(alert.model, alert.version), rule=alert.rule, firing=alert.firing,
                    raised_at_window=alert.raised_at_window, resolved_at_window=alert.resolved_at_window or 0,
                    signal=alert.signal, value=alert.value or 0.0, features=alert.features, segment=alert.segment)
