"""``opml model``: deploy models onto the inference-router, split traffic, promote, roll back, and see
where replicas run.

    opml model deploy --bundle NAME [--context C] | --dir DIR [--version N] [--canary PCT]
    opml model ls | get MODEL | traffic MODEL v1=90 v2=10 | promote MODEL | rollback MODEL
    opml model undeploy MODEL | placement
    opml model rollout MODEL [--abort | --resume [--skip-analysis]] [--json]
    opml model measure MODEL VERSION --kind K [--batch 1,8 --threads 1,2 --opt-level ... --sample N]
    opml model predict MODEL VERSION --kind K [the same grid options]
"""

from __future__ import annotations

import json
import random

import click
from google.protobuf.json_format import MessageToDict
from opml.inference.v1 import deployments_pb2 as pb
from rich.table import Table

from opml_common.cligroup import ClientSession, output_console, pass_session, service_group
from opml_common.perfmodel import ServingConfig, grid
from opml_common.perfmodel.space import EXECUTION_MODES, OPT_LEVELS, PRECISIONS
from opml_inference_router_contract.client import DeploymentClient
from opml_inference_router_contract.model_config import version_number
from opml_inference_router_contract.rollout_spec import BOUNDS

console = output_console()
_STATE = {pb.DEPLOYING: "DEPLOYING", pb.SERVING: "SERVING", pb.FAILED: "FAILED"}


@service_group("model", service="inference-router", client=DeploymentClient, default_target="127.0.0.1:50053")
def model() -> None:
    """Serve models from bundles on the inference-router's pools (placement by SLO and cost)."""


@model.command()
@click.option("--bundle", "bundle", default="", help="Bundle name or UUID in the bundle-store.")
@click.option("--context", "context", default="", help="Bundle-store context of --bundle.")
@click.option("--dir", "model_dir", default="", help="A model directory on the router's machine (development).")
@click.option("--version", "version", default=0, type=int, help="Version number; default: the next one.")
@click.option("--canary", "canary", default=0.0, type=float, help="Start as a canary with this % of the traffic.")
@pass_session
def deploy(session: ClientSession, bundle: str, context: str, model_dir: str, version: int, canary: float) -> None:
    """Deploy a bundle (or a model directory); returns once the version serves."""
    if bool(bundle) == bool(model_dir):
        raise click.UsageError("give exactly one of --bundle NAME (with --context) or --dir DIR")
    if bundle and not context:
        raise click.UsageError("--bundle needs --context (the bundle-store context that holds it)")
    what = f"contexts/{context}/bundles/{bundle}" if bundle else model_dir
    with session.client() as client, console.status(f"deploying {what}: fetch, profile, place, load..."):
        deployment = client.deploy(bundle=bundle, context=context, model_dir=model_dir, version=version,
                                   canary_percent=canary)
    _show(deployment)


@model.command("ls")
@pass_session
def list_(session: ClientSession) -> None:
    """Deployed models, their versions and traffic."""
    with session.client() as client:
        deployments = client.list()
    table = Table("model", "stable", "versions (state, traffic)", "replicas")
    for deployment in deployments:
        versions = ", ".join(f"v{v.version} {_STATE.get(v.state, '?')} {v.traffic_percent:g}%"
                             for v in deployment.versions)
        table.add_row(deployment.model, str(deployment.stable_version or "-"), versions,
                      str(sum(len(v.replicas) for v in deployment.versions)))
    console.print(table)


@model.command()
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the Deployment message as JSON.")
@pass_session
def get(session: ClientSession, name: str, as_json: bool) -> None:
    """One model: versions, traffic, replicas, profiles, state."""
    with session.client() as client:
        deployment = client.get(name)
    if as_json:
        click.echo(json.dumps(MessageToDict(deployment), indent=2))
    else:
        _show(deployment)


@model.command()
@click.argument("name")
@click.argument("weights", nargs=-1, required=True)
@pass_session
def traffic(session: ClientSession, name: str, weights: tuple[str, ...]) -> None:
    """Split traffic across versions: ``opml model traffic MODEL v1=90 v2=10``."""
    split = {}
    for item in weights:
        version, sep, weight = item.partition("=")
        version = version.removeprefix("v")
        try:
            split[version] = float(weight)
        except ValueError:
            raise click.BadParameter(f"{item!r}: use VERSION=WEIGHT, e.g. v1=90", param_hint="WEIGHTS") from None
        if not sep or version_number(version) is None:
            raise click.BadParameter(f"{item!r}: use VERSION=WEIGHT, e.g. v1=90", param_hint="WEIGHTS")
    with session.client() as client:
        _show(client.set_traffic(name, split))


@model.command()
@click.argument("name")
@click.option("--version", "version", default=0, type=int, help="Version to promote; default: the canary.")
@pass_session
def promote(session: ClientSession, name: str, version: int) -> None:
    """Give a version (default: the canary) all traffic; older versions are retired."""
    with session.client() as client:
        _show(client.promote(name, version))


@model.command()
@click.argument("name")
@pass_session
def rollback(session: ClientSession, name: str) -> None:
    """Send all traffic back to the stable version and retire the canary."""
    with session.client() as client:
        _show(client.rollback(name))


@model.command()
@click.argument("name")
@click.option("--abort", is_flag=True, help="Abort it: all traffic back to the stable version (admin role).")
@click.option("--resume", is_flag=True, help="Resume a paused rollout (admin role).")
@click.option("--skip-analysis", is_flag=True, help="With --resume: pass the analysis it is paused at.")
@click.option("--json", "as_json", is_flag=True, help="Print the Rollout message as JSON.")
@pass_session
def rollout(session: ClientSession, name: str, abort: bool, resume: bool, skip_analysis: bool,
            as_json: bool) -> None:
    """A model's progressive rollout (rollout.yaml): its steps, where it is, each check's numbers."""
    if abort and resume:
        raise click.UsageError("--abort and --resume exclude each other")
    if skip_analysis and not resume:
        raise click.UsageError("--skip-analysis goes with --resume")
    with session.client() as client:
        if abort:
            reply = client.abort_rollout(name)
        elif resume:
            reply = client.resume_rollout(name, skip_analysis=skip_analysis)
        else:
            reply = client.get_rollout(name)
    if as_json:
        click.echo(json.dumps(MessageToDict(reply), indent=2))
        return
    _show_rollout(reply)


def _show_rollout(reply: pb.Rollout) -> None:
    console.print(f"models/{reply.model}: version {reply.version} against stable {reply.stable_version}: "
                  f"[bold]{reply.phase}[/bold] at step {reply.step}" + (f" ({reply.reason})" if reply.reason else ""))
    steps = Table("step", "kind", "spec", "")
    for index, step in enumerate(reply.steps):
        if step.kind == "weight":
            spec = f"{step.weight_percent:g}% of the traffic"
        elif step.kind == "shadow":
            spec = (f"a copy of {step.shadow_percent:g}% of the stable version's requests, output "
                    f"{step.shadow_output or '(first)'} compared")
        elif step.kind == "pause":
            spec = f"{step.pause_s:g} s" if step.pause_s else "until resumed"
        else:
            spec = (f"{step.count} x {step.interval_s:g} s, failure_limit {step.failure_limit}, "
                    f"inconclusive_limit {step.inconclusive_limit}: {', '.join(step.checks)}")
        here = "<- here" if index == reply.step and reply.phase in ("RUNNING", "PAUSED") else ""
        steps.add_row(str(index), step.kind, spec, here)
    console.print(steps)
    if reply.checks:
        console.print(f"last measurement ({reply.measurements} taken, {reply.failed} failed, "
                      f"{reply.inconclusive} inconclusive in this analysis):")
        checks = Table("check", "verdict", "new", "stable", "bound", "evidence (new/stable)", "why")
        for check in reply.checks:
            stable = "-" if check.check == "disagreement" else f"{check.stable_value:.4g}"
            checks.add_row(check.check, check.verdict, f"{check.new_value:.4g}", stable,
                           f"{BOUNDS.get(check.check, '')} {check.bound:g}",
                           f"{check.new_requests}/{check.stable_requests} {_EVIDENCE.get(check.check, 'requests')}",
                           check.reason)
        console.print(checks)


_EVIDENCE = {"disagreement": "compared", "estimated_accuracy": "predictions", "accuracy": "labels"}


@model.command()
@click.argument("name")
@pass_session
def undeploy(session: ClientSession, name: str) -> None:
    """Stop serving every version of a model (admin role)."""
    with session.client() as client:
        client.undeploy(name)
    console.print(f"undeployed {name}")


@model.command()
@click.option("--json", "as_json", is_flag=True, help="Print the Placement message as JSON.")
@pass_session
def placement(session: ClientSession, as_json: bool) -> None:
    """Where replicas run: per worker, its models and the slots and memory they use; the plan's cost."""
    with session.client() as client:
        plan = client.placement()
    if as_json:
        click.echo(json.dumps(MessageToDict(plan), indent=2))
        return
    table = Table("worker", "kind", "address", "alive", "slots", "memory MiB", "replicas")
    for worker in plan.workers:
        replicas = ", ".join(f"{r.model} v{r.version} ({r.precision}, batch {r.max_batch})" for r in worker.replicas)
        table.add_row(worker.worker, worker.pool_kind, worker.address,
                      "yes" if worker.alive else "no", f"{worker.used_slots}/{worker.slots}",
                      f"{worker.used_memory_mib:.0f}/{worker.memory_mib:.0f}", replicas or "-")
    console.print(table)
    console.print(f"cost: {plan.cost_per_hour:.3f}/h for the replicas' slots, "
                  f"{plan.active_worker_cost_per_hour:.3f}/h for the workers in use")
    for item in plan.unplaced:
        console.print(f"[yellow]unplaced[/yellow] {item.model} v{item.version}: {item.reason}")
    if plan.unavailable_pool_kinds:
        console.print(f"pool kinds without workers here: {', '.join(plan.unavailable_pool_kinds)}")


def _grid_options(command):
    """The serving-configuration grid options of ``measure`` and ``predict`` (comma-separated lists)."""
    for name, default, what in (("--batch", "1,8,32", "batch sizes"), ("--threads", "1", "intra-op thread counts"),
                                ("--opt-level", "all", f"graph optimization levels ({', '.join(OPT_LEVELS)})"),
                                ("--mode", "sequential", f"execution modes ({', '.join(EXECUTION_MODES)})"),
                                ("--precision", "fp32", f"precisions ({', '.join(PRECISIONS)})")):
        command = click.option(name, default=default, show_default=True, help=f"Comma-separated {what}.")(command)
    command = click.option("--sample", default=0, type=int, help="Take this many configurations of the grid at "
                           "random (0: all).")(command)
    command = click.option("--seed", default=0, type=int, help="Seed of --sample.")(command)
    return click.option("--kind", "kind", required=True, help="The pool kind.")(command)


def _configs(batch: str, threads: str, opt_level: str, mode: str, precision: str, sample: int,
             seed: int) -> list[ServingConfig]:
    def items(text: str) -> list[str]:
        return [item.strip() for item in text.split(",") if item.strip()]

    try:
        configs = list(grid(batches=[int(b) for b in items(batch)], threads=[int(t) for t in items(threads)],
                            opt_levels=items(opt_level), modes=items(mode), precisions=items(precision)))
    except ValueError as error:
        raise click.BadParameter(f"--batch and --threads take integers: {error}") from None
    if sample:
        configs = random.Random(seed).sample(configs, min(sample, len(configs)))
    return configs


def _samples(title: str, samples) -> None:
    table = Table("batch", "threads", "opt level", "mode", "precision", "latency ms", "rows/s", title=title)
    for s in samples:
        table.add_row(str(s.config.batch), str(s.config.threads), s.config.opt_level, s.config.execution_mode,
                      s.config.precision, f"{s.latency_ms:.3f}", f"{s.throughput_rps:,.0f}")
    console.print(table)


@model.command()
@click.argument("name")
@click.argument("version", type=int)
@_grid_options
@click.option("--runs", default=0, type=int, help="Timed batches per configuration and pass (0: 15).")
@click.option("--passes", default=0, type=int, help="Passes over the configurations (0: 3).")
@pass_session
def measure(session: ClientSession, name: str, version: int, kind: str, runs: int, passes: int,
            **grid_options) -> None:
    """Measure serving configurations of a version on a pool kind (kept for ``predict``; writer role)."""
    configs = _configs(**grid_options)
    with session.client() as client, console.status(f"measuring {len(configs)} configurations on {kind}..."):
        kept = client.measure_serving_configs(f"models/{name}/versions/{version}", kind, configs, runs=runs,
                                              passes=passes)
    _samples(f"{name} v{version} on {kind}: {len(kept.samples)} measurements kept", kept.samples)


@model.command()
@click.argument("name")
@click.argument("version", type=int)
@_grid_options
@pass_session
def predict(session: ClientSession, name: str, version: int, kind: str, **grid_options) -> None:
    """Predicted latency and throughput of serving configurations (the performance model's fit said)."""
    with session.client() as client:
        reply = client.predict_serving_performance(f"models/{name}/versions/{version}", kind,
                                                   _configs(**grid_options))
    fit = reply.fit
    how = (f"learnt on {fit.target_samples} measurements of {kind}" if fit.method == "measured" else
           f"transferred from {fit.learned_on} ({fit.source_samples} measurements) with {fit.target_samples} "
           f"of {kind}")
    _samples(f"{name} v{version} on {kind}, predicted: {how}", reply.predictions)


def _show(deployment: pb.Deployment) -> None:
    table = Table("version", "state", "traffic", "replicas", "p99 (pred.)", "source / reason",
                  title=f"{deployment.model} (SLO p99 {deployment.slo_p99_ms:g} ms, "
                        f"{deployment.expected_rate_rps:g} rps expected)")
    for version in deployment.versions:
        replicas = ", ".join(f"{r.worker} {r.pool_kind}/{r.precision}" for r in version.replicas) or "-"
        source = (f"contexts/{version.bundle.context}/bundles/{version.bundle.bundle}"
                  if version.WhichOneof("source") == "bundle" else version.model_dir)
        table.add_row(f"v{version.version}" + (" (stable)" if version.version == deployment.stable_version else ""),
                      _STATE.get(version.state, "?"), f"{version.traffic_percent:g}%", replicas,
                      f"{version.predicted_p99_ms:.2f} ms" if version.replicas else "-",
                      version.reason or source)
    console.print(table)
    for version in deployment.versions:  # the serving configuration placement chose, and why
        for session in sorted({(r.session.threads, r.session.opt_level, r.session.execution_mode, r.session.basis)
                               for r in version.replicas}):
            console.print(f"v{version.version} sessions: {session[0]} intra-op threads, opt {session[1]}, "
                          f"{session[2]} ({session[3]})")
