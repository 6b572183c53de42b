"""Step 6, close the loop with no person: the alert retrains, blesses and rolls out the model.

Shows the platform acting on its own evidence: the job-orchestrator's pipeline ``inspection``
(``triggers: {on_alert: true}``) starts a run for the AlertRaised of step 5 once the scorer confirms
it fires; the run ingests the spans with the new one (line 3 under its new lamps), validates them
(line 3's move is within the validation's bound), trains warm from the serving model, evaluates the
candidate against it per line, blesses and pushes it with its rollout; the inference-router deploys
it beside the serving version and walks the rollout (shadow, analysis, canary weight, analyses) on
the lines' traffic to its promotion, each step and verdict read back from ``opml.deployments.v1``.
After the promotion the traffic goes on, and the scorer's windows of the new version show line 3's
estimated and true accuracy back.
"""

from __future__ import annotations

import json
import time

from opml.jobs.v1 import pipelines_pb2 as pb

from opml_bundle_store_contract.client import BundleStoreClient
from opml_inference_router_contract.client import DeploymentClient
from opml_inference_router_contract.topics import DEPLOYMENTS
from opml_job_orchestrator_contract.pipelineclient import PipelineClient

from .context import Story, wait_for
from .drift import LINE
from .lines import (
    ROLLOUT_TIMEOUT_S,
    WINDOWS_TIMEOUT_S,
    Live,
    show_placement,
    show_windows,
    split_by_line,
    windows_ready,
)
from .pipeline import MODEL, NAME, ended_run, serving_bundle, version_of
from .watch import Seen

RUN_TIMEOUT_S = 120.0
"""How long the alert may take to start a run (the trigger asks the scorer whether it still fires)."""


def triggered_run(client: PipelineClient, story: Story) -> pb.PipelineRun | None:
    """The first run after step 5 began that the alert asked for."""
    alert = story.handed["alert"]
    about = f"{alert.model} version {alert.version}"
    for run in sorted(client.runs(NAME), key=lambda r: r.number):
        if run.number > int(story.handed["runs_before"]) and any(
                t.startswith("alert:") and about in t and f"rule {alert.rule}" in t for t in run.triggers):
            return run
    return None


def per_line(story: Story, run: pb.PipelineRun) -> dict[str, tuple[float | None, float]]:
    """Per line, (the serving model's, the candidate's) accuracy on the new span, from the run's
    evaluation (its result.json)."""
    [output] = [o for s in run.steps if s.step == "judge" for o in s.outputs if o.role == "evaluation"]
    with BundleStoreClient(story.bundles_target) as client:
        metrics = json.loads(b"".join(client.read_file(output.context, output.uuid, "result.json")))["metrics"]
    baseline = metrics.get("baseline", {})
    return {key.removeprefix("line="): (baseline.get(key, {}).get("accuracy"), values["accuracy"])
            for key, values in sorted(metrics["candidate"].items()) if key.startswith("line=")}


def follow_rollout(live: Live, version: int) -> Seen:
    """Print the rollout's events of ``version`` as they come, until it is promoted.

    Raises: SystemExit: it was aborted or paused, or did not end within ROLLOUT_TIMEOUT_S."""
    shown = 0

    def step(events: list[Seen]) -> Seen | None:
        nonlocal shown
        ours = [e for e in events if e.kind.startswith("Rollout") and e.message.version == version]
        for seen in ours[shown:]:
            message = seen.message
            if seen.kind == "RolloutStepStarted":
                spec = message.spec
                what = {"shadow": f"shadow {spec.shadow_percent:g}% of the stable version's requests",
                        "weight": f"weight {spec.weight_percent:g}% of the traffic",
                        "analysis": f"analysis: {spec.count} x {spec.interval_s:g} s, checks {', '.join(spec.checks)}",
                        "pause": f"pause {spec.pause_s:g} s"}.get(spec.kind, spec.kind)
                print(f"   rollout step {message.step + 1}: {what}", flush=True)
            elif seen.kind == "RolloutAnalysisCompleted":
                checks = "; ".join(f"{c.check} {c.verdict.lower()} (new {c.new_value:.3f} over {c.new_requests}, "
                                   f"stable {c.stable_value:.3f} over {c.stable_requests})" for c in message.checks)
                print(f"   rollout step {message.step + 1} measurement {message.measurement}: {message.verdict} "
                      f"{checks}", flush=True)
            else:
                print(f"   event opml.inference.v1.{seen.kind} version {version} offset={seen.offset}"
                      f"{': ' + message.reason if getattr(message, 'reason', '') else ''}", flush=True)
        shown = len(ours)
        return next((e for e in ours if e.kind in ("RolloutPromoted", "RolloutAborted", "RolloutPaused")), None)

    ended = live.watch.wait(f"the rollout of {MODEL} version {version} ending", step, ROLLOUT_TIMEOUT_S)
    if ended.kind != "RolloutPromoted":
        raise SystemExit(f"the rollout of {MODEL} version {version} ended {ended.kind}: {ended.message.reason}")
    return ended


def splits(live: Live, since: float) -> list[tuple[float, dict[str, float]]]:
    """The router's traffic splits of the model from its TrafficChanged events since ``since``."""
    return [(e.at, dict(e.message.traffic_percent)) for e in live.watch.of("TrafficChanged", since)]


def shadow_span(live: Live, version: int, since: float) -> tuple[float, float, float] | None:
    """(start, end, percent) of the rollout's shadow step, when it had one: its mirror lasts until the
    next weight step or the rollout's end."""
    steps = [e for e in live.watch.of("RolloutStepStarted", since) if e.message.version == version]
    ends = ([e for e in steps if e.message.spec.kind == "weight"] + live.watch.of("RolloutPromoted", since)
            + live.watch.of("RolloutAborted", since))
    for seen in steps:
        if seen.message.spec.kind == "shadow":
            end = min((e.at for e in ends if e.at > seen.at), default=time.time())
            return seen.at, end, seen.message.spec.shadow_percent
    return None


def run(story: Story) -> str:
    live: Live = story.live
    alert = story.handed["alert"]
    stable = str(alert.version)
    with PipelineClient(story.jobs_target) as client:
        started = wait_for(f"a run of pipeline {NAME} triggered by the alert", lambda: triggered_run(client, story),
                           timeout_s=RUN_TIMEOUT_S, every_s=0.5)
        print(f"   run {started.number} of pipeline {NAME}, triggered by: {'; '.join(started.triggers)}", flush=True)
        pipeline_run = ended_run(client, started.number)
    story.handed["loop_run"] = pipeline_run.number
    if pipeline_run.state != pb.RUN_STATE_SUCCEEDED or not pipeline_run.blessed:
        raise SystemExit(f"run {pipeline_run.number} ended {pb.RunState.Name(pipeline_run.state)}, "
                         f"blessed={pipeline_run.blessed}: {pipeline_run.message}")
    accuracy = per_line(story, pipeline_run)
    print(f"   blessed=True; accuracy on span {story.handed['today']}, serving model -> candidate: " + ", ".join(
        f"line {line} {'-' if old is None else f'{old:.3f}'} -> {new:.3f}" for line, (old, new) in accuracy.items()))
    story.handed.setdefault("line_accuracy", {})["after the alert"] = {k: new for k, (_, new) in accuracy.items()}
    bundle = serving_bundle(pipeline_run)
    if not bundle:
        raise SystemExit(f"run {pipeline_run.number} pushed nothing: "
                         f"{next(s.decision for s in pipeline_run.steps if s.step == 'ship')}")
    with DeploymentClient(story.router_target) as router:
        version = wait_for(f"the router serving bundle {bundle}", lambda: version_of(router, bundle), timeout_s=180)
        print(f"   version {version.version} deployed beside version {stable}, rollout on "
              f"{DEPLOYMENTS.name}", flush=True)
        promoted = follow_rollout(live, version.version)
        show_placement(next(v for v in router.get(MODEL).versions if v.version == version.version))
    new = str(version.version)
    story.handed.update(promoted=new, serving_version=new)
    print(f"   version {new} promoted; the lines' traffic goes on: the scorer's windows of version {new}", flush=True)
    by_line = split_by_line(story, live, new, promoted.at)
    live.watch.wait(f"windows of {MODEL} version {new} after its promotion",
                    windows_ready(new, promoted.at, story.scale.recovered_windows, by_line), WINDOWS_TIMEOUT_S)
    before = show_windows(live, stable, float(story.handed["drift_at"]), f"v{stable} drifted", until=promoted.at)
    after = show_windows(live, new, promoted.at, f"v{new} promoted")
    live.close()
    story.handed["quality"] = [  # at the window's last prediction, not when the scorer got to it
        (e.message.last_time.ToNanoseconds() / 1e9 if e.message.HasField("last_time") else e.at, e.message.version, e.message.segment, e.message.window,
         e.message.estimate if e.message.HasField("estimate") else None,
         e.message.true_value if e.message.HasField("true_value") else None, e.message.rows)
        for e in live.watch.of("WindowScored")]
    story.handed["answers"] = list(live.traffic.answers)
    story.handed["traffic"] = [(live.started, {stable: 100.0})] + splits(live, live.started)
    story.handed["shadow"] = shadow_span(live, version.version, live.started)
    story.handed["traffic_started"] = live.started
    failed = sum(live.traffic.failed.values())
    print(f"   the lines' traffic: {live.traffic.answered()} requests answered, {failed} failed "
          f"{dict(live.traffic.failed) if failed else ''}, {live.traffic.labelled} labelled late", flush=True)
    key = str(LINE) if str(LINE) in after else "all"
    where = f"line {LINE}" if key != "all" else "all lines"
    drifted = f"{before[key][0]:.3f} -> " if key in before else ""
    truth = (live.traffic.accuracy(stable, float(story.handed["drift_at"]), promoted.at).get(str(LINE)),
             live.traffic.accuracy(new, promoted.at).get(str(LINE)))
    return (f"run {pipeline_run.number} (alert) blessed, version {new} promoted; line {LINE} true accuracy "
            + " -> ".join("-" if t is None else f"{t:.3f}" for t in truth)
            + f", {where} estimated {drifted}{after[key][0]:.3f}")
