"""The platform's main job tells its whole story, and then every Grafana panel shows data on a real
Prometheus scraping the services.

One run of the main job (quick scale) serves both checks, as one story: :func:`check_the_story` reads what
it printed and drew (every step's outcome, the loop's alert, rollout and promotion, the federated model
served), then the dashboards are checked over the same run.

The services run as `make up` runs them (real processes, auth off, the router's default fleet), a real
Prometheus (:class:`opml_devstack.prometheus.PrometheusServer`) scrapes each one's /metrics port (the
inference-router's carries its workers' series), the main job runs, a second round repeats what it did
once (:func:`second_round` says why), a traced job ships step metrics over two scrapes
(:func:`traced_job_over_two_scrapes`), then serving load goes to the router over KServe v2. Each query of each panel of deploy/compose/grafana is then asked over the run as Grafana
asks it (a range query; its variables at their "All" value, Grafana's ranges as 1m) and must give a
number, except the panels of events this run never causes, listed in :data:`EXPECTED_EMPTY` with why.
The metrics those read must still be declared to Prometheus (exported, only never incremented).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
from opml.inference.v1 import deployments_pb2
from opml.jobs.v1 import jobs_pb2
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from opml_common.errors import NotFound
from opml_devstack.prometheus import PrometheusError, PrometheusServer, has_finite_value
from opml_devstack.testing.bus import poll_until
from opml_devstack.testing.services import env_prefix
from opml_inference_router_contract.client import DeploymentClient
from opml_job_orchestrator_contract.client import JobClient
from opml_job_orchestrator_contract.jobspec import load_spec
from opml_monitoring_scorer_contract.client import MonitoringClient
from opml_trace_collector_contract.client import TraceCollectorClient

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy" / "compose" / "grafana" / "dashboards").glob("*.json"))
GRAFANA_RANGE = "1m"  # for $__rate_interval, $__interval and $__range: four scrapes' worth and more
KERAS_UNTIL_TOLD = Path(__file__).resolve().parent / "programs" / "keras_until_told.py"
MODEL = "inspection"  # what the main job's pipeline deploys (and its loop rolls out again)
TERMINAL = {jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JOB_STATE_FAILED, jobs_pb2.JOB_STATE_CANCELLED}

_NO_FAILURE = "nothing fails in this run"
EXPECTED_EMPTY: dict[tuple[str, str], str] = {
    # (dashboard uid, panel title[/refId]) -> why this run leaves it empty. Everything else must show data.
    ("opml-bundle-store", "Bundles deleted (time range)"): "the main job deletes no bundle",
    ("opml-bundle-store", "Publish failures by topic"): _NO_FAILURE,
    ("opml-inference-router", "Shed requests by reason"): "the load stays under the admission limits",
    ("opml-inference-router", "Replica ejections"): _NO_FAILURE,
    ("opml-inference-router", "Worker restarts"): "no worker dies",
    ("opml-inference-router", "Predictions published and dropped/B"): "no prediction is dropped",
    ("opml-inference-router", "Publish failures by topic"): _NO_FAILURE,
    ("opml-inference-router", "Worker hosts alive and lost by site"): "make up's fleet has no remote site: no host agent",
    ("opml-inference-router", "Site links: round trip and bandwidth"): "make up's fleet has no remote site: no link to measure",
    ("opml-inference-router", "Bundles sent to hosts"): "make up's fleet has no remote site: no bundle is sent",
    ("opml-job-orchestrator", "Jobs preempted"): "no job is preempted (jobs{state} has only states jobs reached)",
    ("opml-job-orchestrator", "Jobs retrying"): "no job fails, so none retries",
    ("opml-job-orchestrator", "Preemptions and retries by class"): "no job is preempted nor retried",
    ("opml-job-orchestrator", "Publish failures by topic"): _NO_FAILURE,
    ("opml-overview", "Events published/C"): "the trace-collector service publishes capture events only; none armed",
    ("opml-overview", "Dead-lettered events"): "no poison event",
    ("opml-overview", "Publish failures"): _NO_FAILURE,
    ("opml-overview", "Events refused: untrusted source"): "no forged or foreign event in this run",
    ("opml-pipelines", "Trigger events handled/B"): "no forged or foreign span or alert event in this run",
    ("opml-fl-coordinator", "RPC errors by method and code"): _NO_FAILURE + " (every fl-coordinator call of the "
                                                                            "main job's federation succeeds)",
    ("opml-fl-coordinator", "Publish failures by topic"): _NO_FAILURE,
    ("opml-automl-controller", "RPC errors by method and code"): _NO_FAILURE + " (every automl-controller call succeeds)",
    ("opml-automl-controller", "Publish failures by topic"): _NO_FAILURE,
    ("opml-trace-collector", "Captures armed (time range)"): "the main job arms no op-level capture",
    ("opml-trace-collector", "Captures completed (time range)"): "the main job arms no op-level capture",
    ("opml-trace-collector", "Captures failed (time range)"): "the main job arms no op-level capture",
    ("opml-trace-collector", "Captures expired (time range)"): "the main job arms no op-level capture",
    ("opml-trace-collector", "Captures by outcome"): "the main job arms no op-level capture",
    ("opml-trace-collector", "RPC errors by method and code"): _NO_FAILURE,
    ("opml-trace-collector", "Events published by type"): "the service publishes capture events only; none armed",
    ("opml-trace-collector", "Publish failures by topic"): _NO_FAILURE,
    ("opml-monitoring-scorer", "MPP recalibrations from labels"): "the main job labels 2 % of its answers, fewer than "
                                                                "a recalibration's 200 a version",
    ("opml-monitoring-scorer", "Events refused: untrusted source"): "no forged or foreign event in this run",
    ("opml-monitoring-scorer", "Predictions dead-lettered or skipped by reason, and put in the segment other/C"):
        "no version is split into more than 64 segments (the main job's has four lines)",
    ("opml-monitoring-scorer", "Publish failures by topic"): _NO_FAILURE,
}


def _panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def dashboard_queries() -> list[tuple[str, str, str, str]]:
    """(dashboard uid, panel title, refId, PromQL as Grafana sends it) of every panel query."""
    queries = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        values = {}
        for variable in dashboard.get("templating", {}).get("list", []):
            if variable.get("includeAll"):
                values[variable["name"]] = variable.get("allValue") or ".*"
            else:
                values[variable["name"]] = variable.get("current", {}).get("value") or ".*"
        for panel in _panels(dashboard["panels"]):
            for target in panel.get("targets", []):
                expr = re.sub(r"\$__(rate_interval|interval|range)\b", GRAFANA_RANGE, target["expr"])
                expr = re.sub(r"\$\{?(\w+)\}?", lambda found, values=values: values.get(found.group(1), found.group(0)),
                              expr)
                assert "$" not in expr, f"{dashboard['uid']} {panel['title']!r}: a variable left in {expr}"
                queries.append((dashboard["uid"], panel["title"], target["refId"], expr))
    return queries


def expected_empty(uid: str, title: str, ref: str) -> str | None:
    return EXPECTED_EMPTY.get((uid, f"{title}/{ref}")) or EXPECTED_EMPTY.get((uid, title))


def metric_family(name: str) -> str:
    """The family Prometheus' metadata knows a series by (histograms' and counters' suffixes dropped)."""
    return re.sub(r"_(bucket|sum|count|total)$", "", name)


def serve_load(target: str, *, requests: int, threads: int = 8) -> int:
    """``requests`` KServe v2 ModelInfer calls from ``threads`` clients at once (so the workers batch);
    returns how many answered."""
    with triton.InferenceServerClient(target) as client:
        metadata = client.get_model_metadata(MODEL)
    [model_input] = metadata.inputs
    shape = [dim if dim > 0 else 1 for dim in model_input.shape]
    answered, failures, lock = [0], [], threading.Lock()

    def run(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with triton.InferenceServerClient(target) as client:
            for _ in range(requests // threads):
                data = rng.random(shape, dtype=np.float32)
                tensor = triton.InferInput(model_input.name, shape, model_input.datatype)
                tensor.set_data_from_numpy(data)
                try:
                    client.infer(MODEL, [tensor])
                except Exception as error:  # noqa: BLE001 - counted and reported below
                    with lock:
                        failures.append(error)
                    continue
                with lock:
                    answered[0] += 1

    workers = [threading.Thread(target=run, args=(seed,)) for seed in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not failures, f"{len(failures)} inferences failed, the first: {failures[0]}"
    return answered[0]


def second_round(env: dict[str, str], *, name: str) -> None:
    """What the main job did once, again, now that Prometheus has seen it.

    A labelled series is born with its first event (prometheus-client creates ``labels(...)`` children
    on first use), so Prometheus' first sample already counts it and ``rate()`` sees no increase: a panel
    of something that happened once, before the series was scraped, is empty. The platform in use does
    these things again and again; here: a second TE job (queue wait) and the trace-collector's queries
    (its RPC latency). (The main job's loop rolled version 2 of the model out already.)
    """
    with JobClient(env["OPML_JOB_ORCHESTRATOR_TARGET"]) as jobs:
        jobs.submit(load_spec({"name": name, "class": "TE", "command": [sys.executable, "-c", "pass"],
                               "roles": {"worker": {"replicas": 1, "resources": {"cpu": "100m", "memory": "128Mi"}}}}))
        state = poll_until(lambda: (s := jobs.get(name).status.state) in TERMINAL and s, timeout_s=120,
                           every_s=0.5, what=f"job {name} ending")
        assert state == jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JobState.Name(state)
    with TraceCollectorClient(env["OPML_TRACE_COLLECTOR_TARGET"]) as traces:  # the tuning trials' traced jobs
        traced = [job.job for job in traces.list_jobs()]
        assert traced and any(traces.list_runs(job) for job in traced) and traces.summary(traced[0])


def scorer_monitors_the_served_versions(env: dict[str, str]) -> None:
    """Waits until the monitoring-scorer has set up every version of the model that takes traffic. It
    does so by itself from the router's ModelDeployed, reading the bundle's reference set in the
    background; a prediction that comes before is counted and skipped, so a load sent earlier would
    leave the scorer's window panels empty in one run and full in the next."""
    with DeploymentClient(env["OPML_INFERENCE_ROUTER_TARGET"]) as router:
        versions = [str(v.version) for v in router.get(MODEL).versions
                    if v.state == deployments_pb2.SERVING and v.traffic_percent > 0]
    assert versions

    def monitored() -> bool:
        with MonitoringClient(env["OPML_MONITORING_SCORER_TARGET"]) as scorer:
            try:
                return all(scorer.status(MODEL, version) for version in versions)
            except NotFound:
                return False

    poll_until(monitored, timeout_s=120, what=f"the monitoring-scorer monitoring {MODEL} versions {versions}")
    # and a version it does not monitor: the RPC errors panel, whether or not the wait above met one
    with MonitoringClient(env["OPML_MONITORING_SCORER_TARGET"]) as scorer, pytest.raises(NotFound):
        scorer.status(MODEL, "999")


def scorer_windows(env: dict[str, str]) -> int:
    """Windows the monitoring-scorer closed of the model's versions that take traffic."""
    with DeploymentClient(env["OPML_INFERENCE_ROUTER_TARGET"]) as router, \
            MonitoringClient(env["OPML_MONITORING_SCORER_TARGET"]) as scorer:
        return sum(len(list(scorer.windows(MODEL, str(v.version)))) for v in router.get(MODEL).versions
                   if v.state == deployments_pb2.SERVING and v.traffic_percent > 0)


def traced_job_over_two_scrapes(env: dict[str, str], prometheus: PrometheusServer, *, name: str,
                                workdir: Path) -> None:
    """A traced Keras job whose step metrics reach the trace-collector both before and after a scrape.

    The main job may ship all its steps in one batch (a short fit, or a consumer that reads what waited
    in one go): its series are then born with every count in them and ``rate()`` sees no increase. This
    job trains until told to stop, and is told only once the collector has counted more steps after a
    scrape that followed its first ones.
    """
    stop = workdir / f"{name}.stop"
    with JobClient(env["OPML_JOB_ORCHESTRATOR_TARGET"]) as jobs, \
            TraceCollectorClient(env["OPML_TRACE_COLLECTOR_TARGET"]) as traces:
        jobs.submit(load_spec({"name": name, "class": "TE", "trace": True,
                               "command": [sys.executable, str(KERAS_UNTIL_TOLD), "--stop", str(stop)],
                               "roles": {"worker": {"replicas": 1,
                                                    "resources": {"cpu": "500m", "memory": "1Gi"}}}}))
        try:
            def steps() -> int:  # (ListRuns of a job not reported yet is NOT_FOUND: an RPC error panel's data)
                if name not in {job.job for job in traces.list_jobs()}:
                    return 0
                return sum(run.steps for run in traces.list_runs(name))

            poll_until(steps, timeout_s=240, every_s=0.5, what=f"the first step metrics of {name}")
            prometheus.wait_for_targets_up(since=time.time(), timeout_s=60)
            scraped = steps()
            poll_until(lambda: steps() > scraped, timeout_s=120, every_s=0.5,
                       what=f"step metrics of {name} after a scrape")
        finally:
            stop.touch()
        state = poll_until(lambda: (s := jobs.get(name).status.state) in TERMINAL and s, timeout_s=120,
                           every_s=0.5, what=f"job {name} ending")
        assert state == jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JobState.Name(state)


def check_the_story(stdout: str, out: Path) -> None:
    """What the main job printed and drew says that every step did its part and handed its result on."""
    assert "content hash equal in both contexts" in stdout
    assert "opml.bundles.v1.BundlePushed" in stdout
    assert "steps, patched" in stdout  # the best trial's traced run reached the trace-collector
    assert "MaxTrialsReached" in stdout and "best model committed" in stdout  # the tuning step
    assert "TRIAL_STATE_SUCCEEDED val_accuracy=" in stdout  # the Trace collector read the trials' epochs
    assert "blessed=True" in stdout and "inspection version 1 SERVING 100%" in stdout  # the pipeline
    # the loop: line 3's drift raises an alert, the alert runs the pipeline, its rollout promotes the new model
    [alert] = [line for line in stdout.splitlines() if "event opml.monitoring.v1.AlertRaised" in line]
    assert "inspection version 1 line 3:" in alert, alert  # line 3's own alert, judged against its own rows
    assert "lines 1, 2, 4: no alert on their clean traffic" in stdout
    assert "of pipeline inspection, triggered by: alert: inspection version 1" in stdout
    assert "event opml.inference.v1.RolloutPromoted version 2" in stdout
    assert "version 2 promoted" in stdout
    assert "summary" in stdout
    for plot in ("steps", "accuracy", "rollout", "trials", "federated"):
        assert (out / f"{plot}.png").stat().st_size, plot
    # the federated step: TiFL tiers after the profiling round, the model shipped and served, compared per line
    assert "round 2: tier " in stdout and "inspection-federated version 1 SERVING 100%" in stdout


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_main_job_tells_its_story_and_then_every_panel_shows_data(start_service, stack_specs,
                                                                      settings_env: dict[str, str],
                                                                      unique_prefix: str, tmp_path: Path,
                                                                      job_dir: Path) -> None:
    started = time.time()
    env = {"OPML_MAIN_JOB_REMOTE": f"s3://{unique_prefix.rstrip('-')}/vision-inspection"}
    targets = {}
    for spec in stack_specs:  # as `make up` runs them: auth off, each knows the earlier ones
        process = start_service(spec, tokens=None, extra_env=env)
        env.update(spec.targets(process.env))
        targets[spec.name] = [f"127.0.0.1:{process.env[f'{env_prefix(spec)}METRICS_PORT']}"]
    queries = dashboard_queries()
    with PrometheusServer(workdir=tmp_path / "prometheus", targets=targets, scrape_interval_s=1.0) as prometheus:
        prometheus.wait_for_targets_up(timeout_s=60)
        result = subprocess.run([sys.executable, str(ROOT / "scripts" / "main_job.py"), "--scale", "quick",
                                 "--out", str(tmp_path / "main-job")],
                                env={**os.environ, **settings_env, **env}, capture_output=True, text=True,
                                timeout=720, check=False)
        print(result.stdout)  # the story as it went, with the summary table (shown with -s)
        assert result.returncode == 0, result.stdout + result.stderr
        check_the_story(result.stdout, tmp_path / "main-job")
        prometheus.wait_for_targets_up(since=time.time(), timeout_s=60)  # what the main job did is scraped
        second_round(env, name=f"{unique_prefix}second-job")
        traced_job_over_two_scrapes(env, prometheus, name=f"{unique_prefix}traced-job", workdir=job_dir)
        scorer_monitors_the_served_versions(env)
        # The load in two halves with a scrape between: a version's series are born with its first request,
        # so a load that ends within one scrape interval would show Prometheus no increase at all.
        # Half on the router's own port, half on its native front's (each port's panels need calls).
        assert serve_load(env["OPML_INFERENCE_ROUTER_TARGET"], requests=200) == 200
        assert serve_load(env["OPML_INFERENCE_ROUTER_INFERENCE_TARGET"], requests=200) == 200
        # the scorer closes windows at its own pace: one closed and scraped before the second half, so the
        # second half's windows are an increase Prometheus sees (a histogram born with all its windows shows none)
        poll_until(lambda: scorer_windows(env) >= 1, timeout_s=120, what="the scorer closing a window of the load")
        prometheus.wait_for_targets_up(since=time.time(), timeout_s=60)
        assert serve_load(env["OPML_INFERENCE_ROUTER_TARGET"], requests=200) == 200
        assert serve_load(env["OPML_INFERENCE_ROUTER_INFERENCE_TARGET"], requests=200) == 200
        loaded = time.time()

        def empty_queries() -> list[tuple[str, str, str, str]]:
            """The queries that show no number over the run yet, after one more scrape of every target."""
            prometheus.wait_for_targets_up(since=time.time(), timeout_s=60)
            end = time.time()
            return [query for query in queries if not expected_empty(*query[:3]) and
                    not has_finite_value(prometheus.query_range(query[3], start=started, end=end, step_s=2))]

        # A rate needs two scrapes after the load: ask again after each scrape until all show data.
        deadline = time.monotonic() + 120
        missing = empty_queries()
        while missing and time.monotonic() < deadline:
            missing = empty_queries()
        known = prometheus.metadata()
        undeclared = sorted({f"{uid} {title!r}: {name}" for uid, title, ref, expr in queries
                             if expected_empty(uid, title, ref)
                             for name in re.findall(r"\bopml_\w+", expr) if metric_family(name) not in known})
        shown_anyway = [f"{uid} {title!r} {ref}" for uid, title, ref, expr in queries if expected_empty(uid, title, ref)
                        and has_finite_value(prometheus.query_range(expr, start=started, end=time.time(), step_s=2))]
    print(f"the load ended {loaded - started:.0f}s into the run")
    assert not missing, "panels with no data after the main job and the load:\n" + "\n".join(
        f"  {uid} {title!r} {ref}: {expr}" for uid, title, ref, expr in missing)
    assert not undeclared, ("panels expected empty read metrics Prometheus never saw declared (misnamed or not "
                            "exported?):\n  " + "\n  ".join(undeclared))
    assert not shown_anyway, ("panels listed in EXPECTED_EMPTY show data (their series exist, if only at 0): "
                              f"take them off the list: {shown_anyway}")
    stale = [key for key in EXPECTED_EMPTY if not any((uid, title) == key or (uid, f"{title}/{ref}") == key
                                                     for uid, title, ref, _ in queries)]
    assert not stale, f"EXPECTED_EMPTY names panels no dashboard has: {stale}"


def test_prometheus_server_scrapes_queries_and_reports_errors(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    Counter("demo_things_total", "things done", ("kind",), registry=registry).labels("a").inc(3)
    Gauge("demo_level", "a level", registry=registry).set(7)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        with socket.socket() as nothing:  # a port where nothing answers: that target stays down
            nothing.bind(("127.0.0.1", 0))
            down = f"127.0.0.1:{nothing.getsockname()[1]}"
        prometheus = PrometheusServer(workdir=tmp_path / "p", targets={"demo": [f"127.0.0.1:{server.server_port}"]},
                                      scrape_interval_s=0.5)
        assert 'job_name: "demo"' in prometheus.config_text() and "scrape_interval: 500ms" in prometheus.config_text()
        assert f"--web.listen-address=127.0.0.1:{prometheus.port}" in prometheus.command()
        with prometheus:
            assert prometheus.start() == prometheus.url  # idempotent
            since = time.time()
            [target] = prometheus.wait_for_targets_up(since=since, timeout_s=60)
            assert target["health"] == "up"
            [sample] = prometheus.query('demo_things_total{kind="a"}')
            assert sample["metric"]["job"] == "demo" and sample["value"][1] == "3"
            assert prometheus.query("demo_level * 2")[0]["value"][1] == "14"
            assert prometheus.query("scalar(demo_level)")[0]["value"][1] == "7"
            assert has_finite_value(prometheus.query_range("demo_level", start=since - 5, end=time.time() + 1, step_s=1))
            assert not has_finite_value(prometheus.query("demo_level / 0 - demo_level / 0"))  # NaN draws nothing
            with pytest.raises(PrometheusError, match="bad_data"):
                prometheus.query("sum(demo_level")
        prometheus.stop()  # idempotent
        with pytest.raises(PrometheusError, match="not reachable"):
            prometheus.query("up")
        with PrometheusServer(workdir=tmp_path / "q", targets={"gone": [down]}) as lonely, \
                pytest.raises(TimeoutError, match="gone/"):
            lonely.wait_for_targets_up(timeout_s=8)
    finally:
        server.shutdown()
        thread.join()
    with pytest.raises(ValueError, match="host:port"):
        PrometheusServer(workdir=tmp_path, targets={"demo": ["no-port"]})
    with pytest.raises(TypeError, match="list"):
        PrometheusServer(workdir=tmp_path, targets={"demo": "127.0.0.1:1"})
