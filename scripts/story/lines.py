"""Step 4, serve: the pipeline's model answers the four lines, and the monitoring-scorer watches it.

Shows the inference-router's placement and its KServe v2 front under a steady load, and the
monitoring-scorer's label-free estimates: where the router placed the served version (the model asks
for the cpu pool in fp32 and the accel pool in int8, see ``pipeline_train.py``); an event producer
(``traffic.py``) sends each line's patches, each request carrying its ``line`` parameter, lit as the
newest span says, and labels a share of them late; the scorer's windows of the version come back on
``opml.quality.v1`` with their estimate and, as labels join, their truth. A rollout still under way
(a model step 3 pushed beside the serving one) is carried to its end by this traffic first. The
traffic and the bus watch go on through steps 5 and 6 (``story.live``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from inspection_data import LINES
from opml.inference.v1 import deployments_pb2

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import NotFound
from opml_inference_router_contract.client import DeploymentClient
from opml_monitoring_scorer_contract.client import MonitoringClient
from opml_monitoring_scorer_contract.topics import QUALITY

from .context import Story
from .data import newest_span
from .pipeline import MODEL
from .traffic import Traffic
from .watch import Seen, Watch, windows

WINDOWS_TIMEOUT_S = 240.0
"""How long a step waits for the scorer's windows of a version."""
ROLLOUT_TIMEOUT_S = 300.0
"""How long a rollout may take, with the traffic this story sends."""


@dataclass
class Live:
    """What runs from step 4 to the end of step 6: the traffic and the bus watch."""

    watch: Watch
    traffic: Traffic
    started: float  # time.time() when the traffic began

    def close(self) -> None:
        self.traffic.__exit__(None, None, None)
        self.watch.__exit__(None, None, None)


def serving(router: DeploymentClient) -> deployments_pb2.ModelVersionStatus:
    """The version that takes all of the model's traffic."""
    deployment = router.get(MODEL)
    full = [v for v in deployment.versions if v.state == deployments_pb2.SERVING and v.traffic_percent >= 100]
    if not full:
        raise SystemExit(f"no version of {MODEL} takes all traffic: "
                         + ", ".join(f"v{v.version} {v.traffic_percent:.0f}%" for v in deployment.versions))
    return full[0]


def show_placement(version: deployments_pb2.ModelVersionStatus) -> None:
    kinds = sorted({(r.pool_kind, r.precision) for r in version.replicas})
    print(f"   {MODEL} version {version.version}: {len(version.replicas)} replicas on "
          + ", ".join(f"{r.worker} ({r.pool_kind}, {r.precision})" for r in version.replicas)
          + f"; pools {', '.join(f'{k} {p}' for k, p in kinds)}; predicted p99 {version.predicted_p99_ms:.1f} ms "
            f"at {version.planned_rate_rps:.0f} requests/s", flush=True)


def segmented(events: list[Seen], version: str) -> bool:
    """Whether the scorer splits the version's windows by line (monitoring.yaml ``segment``)."""
    return any(key[1] for key in windows(events, version))


def show_windows(live: Live, version: str, since: float, label: str,
                 until: float = float("inf")) -> dict[str, tuple[float, float | None]]:
    """Per line (or "all" when the version is not split by line) the rows-weighted estimate of the
    version's windows read between ``since`` and ``until``, the scorer's truth from the labels joined
    so far, and the truth of every answer in that time (the producer's); printed. Returns
    {line or "all": (estimate, the producer's truth)}."""
    seen = [e for e in live.watch.of("WindowScored", since) if e.at < until]
    by_segment: dict[str, list] = {}
    split = segmented(seen, version)
    for (_, segment, _), window in sorted(windows(seen, version).items()):
        if bool(segment) == split:
            by_segment.setdefault(segment or "all", []).append(window)
    answers = live.traffic.accuracy(version, since, until)
    shown = {}
    for segment, scored in sorted(by_segment.items()):
        rows = sum(w.rows for w in scored if w.HasField("estimate"))
        estimate = sum(w.estimate * w.rows for w in scored if w.HasField("estimate")) / max(1, rows)
        labelled = sum(w.labelled for w in scored if w.HasField("true_value"))
        truth = (sum(w.true_value * w.labelled for w in scored if w.HasField("true_value")) / labelled
                 if labelled else None)
        shown[segment] = (estimate, answers.get(segment))
        name = f"line {segment}" if segment != "all" else "all lines"
        print(f"   {label} {name:<9}: {len(scored)} windows, estimated accuracy {estimate:.3f} "
              f"({scored[-1].estimator}); from late labels {'-' if truth is None else f'{truth:.3f}'} "
              f"({labelled} rows)", flush=True)
    print(f"   {label} true accuracy of its answers: "
          + ", ".join(f"{'line ' + k if k != 'all' else 'all'} {v:.3f}" for k, v in answers.items()), flush=True)
    return shown


def windows_ready(version: str, since: float, count: int, by_line: bool):
    """A ``Watch.wait`` predicate: ``count`` windows of the version read since ``since``, of each line
    when ``by_line``, else of the version."""
    def ready(events: list[Seen]) -> bool:
        scored = windows([e for e in events if e.at >= since], version)
        if by_line:
            return all(sum(1 for (_, s, _) in scored if s == str(line)) >= count for line in LINES)
        return sum(1 for (_, s, _) in scored if not s) >= count
    return ready


def split_by_line(story: Story, live: Live, version: str, since: float) -> bool:
    """Whether the scorer splits the version's windows by the request parameter ``line`` (its
    monitoring.yaml's ``segment``), asked once it has scored a window of the version."""
    live.watch.wait(f"a window of {MODEL} version {version}", windows_ready(version, since, 1, False),
                    WINDOWS_TIMEOUT_S)
    with MonitoringClient(story.scorer_target) as scorer:
        return scorer.status(MODEL, version).segment_parameter == "line"


def finish_rollout(story: Story, live: Live, router: DeploymentClient) -> None:
    """A rollout under way (step 3 pushed a model beside the serving one) goes on with the traffic."""
    try:
        rollout = router.get_rollout(MODEL)
    except NotFound:  # the model never had one
        return
    if rollout.phase not in ("RUNNING", "PAUSED"):
        return
    print(f"   a rollout of version {rollout.version} is {rollout.phase.lower()} at step {rollout.step + 1}: "
          f"the lines' traffic carries it on", flush=True)
    if rollout.phase == "PAUSED":
        raise SystemExit(f"the rollout of {MODEL} version {rollout.version} is paused: {rollout.reason}")
    ended = live.watch.wait(
        f"the rollout of {MODEL} version {rollout.version} ending",
        lambda events: next((e for e in events if e.kind in ("RolloutPromoted", "RolloutAborted")
                             and e.message.version == rollout.version), None), ROLLOUT_TIMEOUT_S)
    print(f"   {ended.kind} version {rollout.version}", flush=True)


def run(story: Story) -> str:
    with BundleStoreClient(story.bundles_target) as client:
        day, lighting = newest_span(client)
    today = day + 1
    story.handed.update(today=today, lighting=lighting)
    watch = Watch(story.bootstrap, story.topic_prefix, MODEL).__enter__()
    traffic = Traffic(story, MODEL, today, dict(lighting)).__enter__()
    live = story.live = Live(watch, traffic, time.time())
    print(f"   traffic of day {today}: {story.scale.rate_rps:.0f} requests/s of {story.scale.request_rows} patches, the "
          f"lines in turn, each request with parameters={{'line': n}}, through {story.inference_target} "
          f"(KServe v2, tritonclient); lamps " + ", ".join(f"line {n} {v:g}" for n, v in sorted(lighting.items())),
          flush=True)
    print(f"   labels for {story.scale.label_share:.0%} of the requests, {story.scale.label_delay_s:g} s late "
          f"(SubmitLabels: LabelObserved under the platform's label source)", flush=True)
    with DeploymentClient(story.router_target) as router:
        finish_rollout(story, live, router)
        version = serving(router)
    show_placement(version)
    served = str(version.version)
    story.handed["serving_version"] = served
    print(f"   the scorer's windows of version {served} on {QUALITY.name}", flush=True)
    by_line = story.handed["by_line"] = split_by_line(story, live, served, live.started)
    print(f"   the scorer splits them by line: {by_line}", flush=True)
    watch.wait(f"windows of {MODEL} version {served}", windows_ready(served, live.started, 1 if by_line else 2,
                                                                     by_line), WINDOWS_TIMEOUT_S)
    shown = show_windows(live, served, live.started, f"v{served}")
    answered = traffic.answered(served)
    print(f"   {answered} requests answered by version {served}, {sum(traffic.failed.values())} failed, "
          f"{traffic.labelled} labelled late", flush=True)
    if not answered:
        raise SystemExit(f"version {served} answered none of the lines' requests: {list(traffic.errors)}")
    where = ", ".join(sorted({f"{r.pool_kind} {r.precision}" for r in version.replicas}))
    return (f"version {served} on {where}; {answered} requests, estimated accuracy "
            + ", ".join(f"{k} {e:.3f}" for k, (e, _) in shown.items()))
