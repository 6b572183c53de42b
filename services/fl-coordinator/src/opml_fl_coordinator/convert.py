"""Conversions between the core's types and opml.fl.v1 messages.

Weights travel as chunks both ways, so their chunking and bounded reassembly are the contract's
(:mod:`opml_fl_coordinator_contract.weights`), as is :func:`federation_name`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from google.protobuf.timestamp_pb2 import Timestamp
from opml.fl.v1 import fl_pb2 as pb

from opml_common.errors import InvalidArgument
from opml_fl_coordinator.federation import Phase, RoundRecord, Task
from opml_fl_coordinator_contract.names import federation_name

if TYPE_CHECKING:
    from opml_fl_coordinator.coordinator import Hosted

STATES = {Phase.WAITING: pb.FEDERATION_STATE_WAITING, Phase.RUNNING: pb.FEDERATION_STATE_RUNNING,
          Phase.COMPLETED: pb.FEDERATION_STATE_COMPLETED, Phase.STOPPED: pb.FEDERATION_STATE_STOPPED}
_NAME = re.compile(r"^federations/([^/]+)$")


def parse_federation_name(field: str, name: str) -> str:
    match = _NAME.match(name)
    if not match:
        raise InvalidArgument(field, f"must look like federations/{{federation}}, but got {name[:100]!r}")
    return match.group(1)


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def federation_to_proto(hosted: Hosted) -> pb.Federation:
    federation = hosted.federation
    last = federation.history[-1].metrics if federation.history else {}
    return pb.Federation(
        name=federation_name(federation.federation_id), state=STATES[federation.phase],
        config_yaml=hosted.config_yaml, completed_rounds=federation.version, total_rounds=federation.config.rounds,
        reason=federation.reason, create_time=_timestamp(federation.created_at),
        present_clients=len(federation.profiles.present()), known_clients=len(federation.profiles.clients),
        metrics={k: float(v) for k, v in last.items()}, model_bundle=hosted.model_bundle)


def round_to_proto(federation_id: str, record: RoundRecord) -> pb.Round:
    return pb.Round(
        name=f"{federation_name(federation_id)}/rounds/{record.number}", number=record.number,
        start_time=_timestamp(record.started_at), end_time=_timestamp(record.ended_at),
        duration_seconds=record.duration_s, participants=record.participants, dropped=record.dropped,
        rejected=record.rejected, tier=-1 if record.tier is None else record.tier, num_examples=record.num_examples,
        aggregated=record.aggregated, metrics=record.metrics)


def task_header(task: Task | None) -> pb.TaskHeader:
    """The header of ``task`` (None: the federation is done)."""
    if task is None:
        return pb.TaskHeader(kind=pb.TASK_KIND_DONE)
    config = {k: float(v) for k, v in task.config.items() if isinstance(v, (int, float))}
    return pb.TaskHeader(task_id=task.task_id, kind=pb.TASK_KIND_FIT if task.kind == "fit" else pb.TASK_KIND_INIT,
                         round=task.round, config=config, deadline=_timestamp(task.deadline_at),
                         num_arrays=len(task.weights or []))


def metrics_from_proto(metrics: Mapping[str, float]) -> tuple[dict[str, float], list[str]]:
    """At most 64 metrics with names of at most 64 characters: the finite ones, and the names of
    those that are not (a diverged loss: left out, the update itself is not refused for it)."""
    if len(metrics) > 64:
        raise InvalidArgument("header.metrics", f"at most 64 metrics, but got {len(metrics)}")
    long = [k[:100] for k in metrics if len(k) > 64]
    if long:
        raise InvalidArgument("header.metrics", f"names must be <= 64 characters: {long[:3]}")
    finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
    return finite, sorted(set(metrics) - set(finite))
