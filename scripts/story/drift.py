"""Step 5, drift and alert: line 3's lamps change, and the monitoring-scorer says so with no label.

Line 3's lighting changes (dimmed to ``DIMMED`` with a side light, or, where an earlier run's loop
left it dimmed, new lamps at full light again): its patches lose contrast or change their grey
levels. The day's span of every line, line 3 under its new lamps, labelled by QA, is committed as the
next span, so the training the alert starts ingests it. The scorer's windows of the serving version
(each line's, split by the request parameter ``line``, where the model is monitored per line; else
the version's as a whole, of which line 3 is a quarter) show the label-free estimate and the truth
before and after, and a rule raises an alert (line 3's: its estimate under the bound, or its inputs
drifted from line 3's own reference rows or out of the reference's ranges): the ``AlertRaised`` is
read back from ``opml.alerts.v1`` and printed, then line 3's first window wholly under the new lamps
(its estimate against the truth of the answers), and the other lines' alerts (none: their traffic is
clean, and each line is judged against its own reference rows).
"""

from __future__ import annotations

import time

from inspection_data import LINES
from opml.monitoring.v1 import alert_events_pb2

from opml_bundle_store_contract.client import BundleStoreClient
from opml_job_orchestrator_contract.pipelineclient import PipelineClient
from opml_monitoring_scorer_contract.client import MonitoringClient
from opml_monitoring_scorer_contract.topics import ALERTS

from .context import Story
from .data import SPANS, commit_span
from .lines import WINDOWS_TIMEOUT_S, Live, show_windows
from .pipeline import MODEL, NAME
from .watch import Seen

LINE = 3
DIMMED = 0.6
"""Line 3's lamps after the change: the validation measured a grey level moving by 0.19 (Jensen-Shannon)."""
ALERT_TIMEOUT_S = 240.0


def raised_for_line(version: str, since: float, by_line: bool):
    """A ``Watch.wait`` predicate: the serving version's first AlertRaised read since ``since``, of line
    3 when the scorer splits the version by line, else of the whole version."""
    def found(events: list[Seen]) -> Seen | None:
        return next((e for e in events if e.kind == "AlertRaised" and e.at >= since and e.message.version == version
                     and e.message.segment == (str(LINE) if by_line else "")), None)
    return found


def window_after(since: float, by_line: bool):
    """A ``Watch.wait`` predicate: the first window of line 3 (of the whole model when not split by line)
    whose first prediction came after ``since``: wholly under the new lamps. Of any version: the
    version-wide drift may raise its alert before line 3's own, and its loop may roll the next version out
    before the serving one has a whole window of line 3."""
    def found(events: list[Seen]) -> Seen | None:
        return next((e for e in events if e.kind == "WindowScored"
                     and e.message.segment == (str(LINE) if by_line else "")
                     and e.message.first_time.ToNanoseconds() / 1e9 >= since and e.message.HasField("estimate")),
                    None)
    return found


def describe(alert: alert_events_pb2.AlertRaised) -> str:
    evidence = alert.evidence
    where = f"line {alert.segment}" if alert.segment else f"all lines (line {LINE} among them)"
    what = (f"{len(evidence.features)} features drifted, the largest {max(evidence.features.values()):.2f}"
            if evidence.features else f"{evidence.signal} {evidence.value:.3f}")
    return (f"{alert.model} version {alert.version} {where}: rule {alert.rule}, window {evidence.window} "
            f"({evidence.rows} rows): {what}, bound {evidence.bound:g}, score {evidence.score:.3f}")


def other_lines_alerts(story: Story, version: str) -> str:
    """The alerts the scorer holds for the version's other lines (their traffic stays clean), as text."""
    with MonitoringClient(story.scorer_target) as scorer:
        raised = {line: scorer.alerts(MODEL, version, segment=str(line)) for line in sorted(LINES) if line != LINE}
    others = ", ".join(str(line) for line in raised)
    if not any(raised.values()):
        return f"lines {others}: no alert on their clean traffic"
    return f"lines {others}: alerts " + "; ".join(
        f"line {line} {a.rule} ({'firing' if a.firing else 'resolved'}, window {a.raised_at_window})"
        for line, alerts in raised.items() for a in alerts)


def run(story: Story) -> str:
    live: Live = story.live
    version = str(story.handed["serving_version"])
    lighting: dict[int, float] = dict(story.handed["lighting"])
    before, after = lighting[LINE], DIMMED if lighting[LINE] == 1.0 else 1.0
    today = int(story.handed["today"])
    lighting[LINE] = after
    with PipelineClient(story.jobs_target) as pipelines:  # the alert's run is a later one
        story.handed["runs_before"] = max((r.number for r in pipelines.runs(NAME)), default=0)
    with BundleStoreClient(story.bundles_target) as client:
        bundle = commit_span(story, client, today, {line: value for line, value in lighting.items() if value != 1.0})
    print(f"   line {LINE}'s lamps: {before:g} -> {after:g}; the day's span {today} ({SPANS}, every line, labelled "
          f"by QA, line {LINE} under the new lamps) committed: {bundle.uuid}", flush=True)
    changed = time.time()
    story.handed["lighting"] = lighting
    story.handed["drift_at"] = changed
    live.traffic.set_lighting(LINE, after)
    print(f"   waiting for the scorer to raise an alert on version {version} ({ALERTS.name})", flush=True)
    seen = live.watch.wait(f"an AlertRaised for line {LINE} of {MODEL} version {version}",
                           raised_for_line(version, changed, bool(story.handed["by_line"])), ALERT_TIMEOUT_S)
    alert = seen.message
    story.handed["alert"] = alert
    story.handed["alert_at"] = seen.at
    print(f"   event opml.monitoring.v1.AlertRaised offset={seen.offset}: {describe(alert)}", flush=True)
    by_line = bool(story.handed["by_line"])
    where = f"line {LINE}" if by_line else "all lines"
    whole = live.watch.wait(f"a window of {where} wholly under the new lamps",
                            window_after(changed, by_line), WINDOWS_TIMEOUT_S).message
    truth = live.traffic.accuracy(whole.version, changed).get(str(LINE) if by_line else "all")
    print(f"   {where}: the first window wholly under the new lamps (version {whole.version} window "
          f"{whole.window}, {whole.rows} rows): "
          f"estimated accuracy {whole.estimate:.3f} ({whole.estimator}); true accuracy of the answers since the "
          f"change {'-' if truth is None else f'{truth:.3f}'}", flush=True)
    if by_line:
        print(f"   {other_lines_alerts(story, version)}", flush=True)
    earlier = show_windows(live, version, live.started, f"v{version} before", until=changed).get(
        str(LINE) if by_line else "all", (None, None))
    show_windows(live, version, changed, f"v{version} after ")
    estimated = f"{earlier[0]:.3f} -> " if earlier[0] is not None else ""
    true = f"{earlier[1]:.3f} -> " if earlier[1] is not None else ""
    return (f"line {LINE} lamps {before:g} -> {after:g}; alert {alert.rule} on version {version} "
            f"{'line ' + alert.segment if alert.segment else 'all lines'} {seen.at - changed:.0f} s later; {where} "
            f"estimated {estimated}{whole.estimate:.3f}, true {true}{'-' if truth is None else f'{truth:.3f}'}")
