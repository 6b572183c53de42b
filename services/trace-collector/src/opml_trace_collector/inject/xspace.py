"""XSpace (what ``tf.profiler`` writes, ``*.xplane.pb``) to Chrome trace event JSON.

The trace viewer of Perfetto and chrome://tracing reads the result. Planes become processes and
their lines threads. A TensorFlow op event is named ``<op name>:<op type>`` in the XPlane (eager
ops: ``EagerLocalExecute: <type>``); those become ``"cat": "op"`` complete events with
``args.op_type``/``args.op_name``. The rest (executor, Python/C API spans) is ``"cat": "runtime"``
and is dropped when an op filter is set. Traced steps are ``"cat": "step"`` events. Times are
microseconds since the profile started.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_OP = re.compile(r"^(?P<name>[^:]+):(?P<type>[A-Za-z_][\w>.-]*)$")
_EAGER_OP = re.compile(r"^EagerLocalExecute: (?P<type>[A-Za-z_]\w*)$")
_ABSOLUTE_NS = 10**17  # line timestamps past this are epoch times, not offsets from the start


@dataclass(frozen=True)
class StepSpan:
    step: int
    kind: str
    signature: str
    start_ns: int   # epoch nanoseconds
    duration_ns: int


def profile_start_ns(space) -> int:  # noqa: ANN001 - an xplane_pb2.XSpace
    """The profile's start (epoch ns), from the ``Task Environment`` plane; 0 when absent."""
    for plane in space.planes:
        for stat in plane.stats:
            if plane.stat_metadata[stat.metadata_id].name == "profile_start_time":
                return int(stat.uint64_value or stat.int64_value)
    return 0


def _classify(name: str) -> tuple[str, str] | None:
    """(op name, op type) when ``name`` is a TensorFlow op event, else None."""
    match = _OP.match(name)
    if match and "::" not in name:
        return match["name"], match["type"]
    match = _EAGER_OP.match(name)
    if match and not match["type"].startswith("__inference"):
        return match["type"], match["type"]
    return None


def to_chrome(space, *, metadata: dict, steps: Iterable[StepSpan], max_events: int,  # noqa: ANN001
              op_filter: str | None = None) -> tuple[dict, int]:
    """The Chrome trace of ``space`` and how many op events it holds.

    At most ``max_events`` events: metadata and steps first, then ops (earliest first), then
    runtime events; ``metadata.dropped_events`` says how many were left out.
    """
    keep = re.compile(op_filter).search if op_filter else None
    origin = profile_start_ns(space)
    names: list[dict] = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "opml steps"}}]
    step_events = [{"ph": "X", "cat": "step", "name": f"step {s.step}", "pid": 0, "tid": 0,
                    "ts": (s.start_ns - origin) / 1000, "dur": s.duration_ns / 1000,
                    "args": {"kind": s.kind, "signature": s.signature}} for s in steps]
    ops: list[dict] = []
    runtime: list[dict] = []
    for pid, plane in enumerate(space.planes, start=1):
        if not plane.lines:
            continue
        names.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": plane.name}})
        kinds = {mid: (md.name, _classify(md.name)) for mid, md in plane.event_metadata.items()}
        for tid, line in enumerate(plane.lines, start=1):
            names.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                          "args": {"name": line.display_name or line.name or str(line.id)}})
            base_ns = line.timestamp_ns - origin if line.timestamp_ns > _ABSOLUTE_NS else line.timestamp_ns
            base_ps = base_ns * 1000
            for event in line.events:
                name, op = kinds.get(event.metadata_id, ("?", None))
                ts = (base_ps + event.offset_ps) / 1e6
                dur = event.duration_ps / 1e6
                if op is not None:
                    if keep is None or keep(op[0]) or keep(op[1]):
                        ops.append({"ph": "X", "cat": "op", "name": op[0], "pid": pid, "tid": tid, "ts": ts,
                                    "dur": dur, "args": {"op_type": op[1], "op_name": op[0]}})
                elif keep is None:
                    runtime.append({"ph": "X", "cat": "runtime", "name": name, "pid": pid, "tid": tid,
                                    "ts": ts, "dur": dur})
    budget = max(0, max_events - len(names) - len(step_events))
    dropped = max(0, len(ops) + len(runtime) - budget)
    if len(ops) > budget:
        ops = sorted(ops, key=lambda e: e["ts"])[:budget]
        runtime = []
    elif len(ops) + len(runtime) > budget:
        runtime = sorted(runtime, key=lambda e: e["ts"])[:budget - len(ops)]
    trace = {"traceEvents": names + step_events + ops + runtime, "displayTimeUnit": "ms",
             "metadata": {**metadata, "dropped_events": dropped, "op_filter": op_filter or ""}}
    return trace, len(ops)
