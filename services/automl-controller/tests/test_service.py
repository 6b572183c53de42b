"""The automl-controller service through the real broker, Redis and job-orchestrator (both services as
processes, auth on): trials are real TE jobs running a small Python program that prints its metrics."""

from __future__ import annotations

import asyncio
import io
import json
import signal
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml
from opml.automl.v1 import automl_pb2 as pb
from opml.automl.v1 import events_pb2
from opml.jobs.v1 import jobs_pb2

from opml_automl_controller.jobs import JobView, OrchestratorJobs
from opml_automl_controller_contract.client import ExperimentClient
from opml_automl_controller_contract.topics import EXPERIMENTS
from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import FailedPrecondition, InvalidArgument, Unauthenticated
from opml_devstack.testing.bus import poll_until, read_records
from opml_devstack.testing.metrics import samples, scrape
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_inference_router_contract.rollout_spec import RolloutSpec
from opml_job_orchestrator_contract.client import JobClient

# A trial: 4 epochs; with --slow-bad, a bad one (x > 0, from trial 2 on: trials 0 and 1 are good so
# the median rule has its 2 completed trials) would train for 600 epochs unless stopped.
TRIAL = textwrap.dedent("""
    import argparse, sys, time
    p = argparse.ArgumentParser()
    p.add_argument("--x", type=float)
    p.add_argument("--mode", default="stdout")
    p.add_argument("--slow-bad", action="store_true")
    p.add_argument("--name", default="t-t0")
    p.add_argument("--save-model", action="store_true")
    p.add_argument("--keep-grant", default="")
    a = p.parse_args()
    if a.slow_bad and int(a.name.rsplit("-t", 1)[1]) < 2:
        a.x = -abs(a.x)
    if a.mode == "fail":
        print("loading data failed", file=sys.stderr)
        sys.exit(3)
    epochs = 600 if a.x > 0 and a.slow_bad else 4
    for epoch in range(epochs):
        loss = 10.0 + a.x + epoch if a.x > 0 else (a.x - 0.25) ** 2 + 1.0 / (epoch + 1)
        if a.mode == "push":
            from opml_automl_controller.sdk import report
            report(loss=loss, accuracy=1 / (1 + loss))
        else:
            print(f"epoch {epoch}: loss={loss:.6f} accuracy={1 / (1 + loss):.6f}", flush=True)
        time.sleep(0.05)
    if a.save_model:
        import numpy as np
        from opml_automl_controller.sdk import model_dir, save_model
        (model_dir() / "weights.txt").write_text(str(a.x))
        (model_dir() / "model.yaml").write_text("name: quadratic\\n")
        x = np.linspace(-1, 1, 64)
        save_model(model_dir(), reference={"features": {"x": x}, "predicted": (x > a.x).astype(np.int64),
                                           "labels": (x > 0.25).astype(np.int64)})
    if a.keep_grant:  # as a job that leaks its env would: someone keeps its grant past its end
        import os, pathlib
        pathlib.Path(a.keep_grant, a.name).write_text(os.environ["AUTOML_MODEL_GRANT"])
""")

# A trial that uses its upload grant for what it does not allow: another trial's bundle, the
# experiment's best bundle, another context, a read of the committed models; each refusal is printed
# (the grant itself never is). Its loss is its number, and it uploads nothing of its own.
GRANT_ABUSER = textwrap.dedent("""
    import os, sys
    from opml_bundle_store_contract.client import BundleStoreClient
    from opml_common.errors import OpmlError
    name = sys.argv[1]
    number = int(name.rsplit("-t", 1)[1])
    other = name.rsplit("-t", 1)[0] + "-t" + str((number + 1) % 2)
    grant = os.environ["AUTOML_MODEL_GRANT"]
    with BundleStoreClient(os.environ["AUTOML_BUNDLE_STORE_TARGET"], token=grant) as store:
        for what, call in (("other", lambda: store.add("automl", other, {"m": b"x"})),
                           ("best", lambda: store.add("automl", "abused-best", {"m": b"x"})),
                           ("context", lambda: store.add("elsewhere", name, {"m": b"x"})),
                           ("list", lambda: store.list_bundles("automl")),
                           ("commit", lambda: store.add("automl", name, {"m": b"x"}, commit=True)),
                           ("grant", lambda: store.create_upload_grant("automl", other, ttl_s=60, max_bytes=1))):
            try:
                call()
                print(f"allowed {what}")
            except OpmlError as error:
                print(f"refused {what}: {error.code}", flush=True)
    print(f"loss={number}", flush=True)
""")

NODE = {"name": "n0", "cpu_millis": 8000, "memory_mib": 8192, "gpu": 0}


def experiment_yaml(name: str, program: Path, *, max_trials: int, parallel: int = 3, goal: float | None = None,
                    early: bool = False, mode: str = "stdout", max_failed: int = 3, collector: str = "StdOut",
                    save_model: bool = False, argv: list[str] | None = None, model: dict | None = None,
                    keep_grant: Path | None = None) -> str:
    spec: dict = {
        "objective": {"type": "minimize", "objectiveMetricName": "loss", "additionalMetricNames": ["accuracy"],
                      **({"goal": goal} if goal is not None else {})},
        "algorithm": {"algorithmName": "random", "algorithmSettings": [{"name": "random_state", "value": "3"}]},
        "parallelTrialCount": parallel, "maxTrialCount": max_trials, "maxFailedTrialCount": max_failed,
        "metricsCollectorSpec": {"collector": {"kind": collector}},
        "parameters": [{"name": "x", "parameterType": "double", "feasibleSpace": {"min": "-1", "max": "1"}}],
        "trialTemplate": {
            "primaryContainerName": "main",
            "trialParameters": [{"name": "x", "reference": "x"},
                                {"name": "trialName", "reference": "${trialSpec.Name}"}],
            "trialSpec": {"apiVersion": "batch/v1", "kind": "Job", "spec": {"template": {"spec": {"containers": [{
                "name": "main", "image": "python:3.11",
                "command": [sys.executable, str(program), *(argv if argv is not None else [
                    "--x=${trialParameters.x}", f"--mode={mode}", "--name=${trialParameters.trialName}",
                    *(["--save-model"] if save_model else []), *(["--slow-bad"] if early else []),
                    *([f"--keep-grant={keep_grant}"] if keep_grant else [])])],
                "resources": {"requests": {"cpu": "500m", "memory": "128Mi"}}}]}}}},
        },
    }
    if model is not None:
        spec["model"] = model
    if early:
        spec["earlyStopping"] = {"algorithmName": "medianstop", "algorithmSettings": [
            {"name": "min_trials_required", "value": "2"}, {"name": "start_step", "value": "2"}]}
    return yaml.safe_dump({"apiVersion": "kubeflow.org/v1beta1", "kind": "Experiment",
                           "metadata": {"name": name}, "spec": spec})


@pytest.fixture
def program(job_dir: Path) -> Path:
    path = job_dir / "trial.py"  # a trial's job runs as a user of its own: tmp_path is the test's alone
    path.write_text(TRIAL)
    return path


@pytest.fixture
def orchestrator(start_service: ServiceStarter):
    return start_service("job-orchestrator", extra_env={
        "OPML_JOB_ORCHESTRATOR_NODES": json.dumps([NODE]), "OPML_JOB_ORCHESTRATOR_TERMINATE_GRACE_S": "2",
        "OPML_JOB_ORCHESTRATOR_LOG_POLL_S": "0.05", "OPML_JOB_ORCHESTRATOR_MAX_RETRIES": "0"})


@pytest.fixture
def controller_env(start_service: ServiceStarter, orchestrator, trials_dir: Path) -> dict[str, str]:
    """One controller's environment (ports, home, trials' folder, Redis prefix), reused by a restarted process."""
    return start_service.env("automl-controller", extra_env={
        "OPML_AUTOML_CONTROLLER_JOB_ORCHESTRATOR_TARGET": orchestrator.target,
        "OPML_AUTOML_CONTROLLER_JOB_ORCHESTRATOR_TOKEN": TOKENS["writer"],
        "OPML_AUTOML_CONTROLLER_RETRY_S": "0.2",
        "OPML_AUTOML_CONTROLLER_TRIALS_DIR": str(trials_dir),
    })


@pytest.fixture
def controller(start_service: ServiceStarter, controller_env: dict[str, str]):
    return start_service("automl-controller", env=controller_env)


def ended(client: ExperimentClient, name: str, *, timeout_s: float = 90) -> pb.Experiment:
    poll_until(lambda: client.get(name).status.state not in (pb.EXPERIMENT_STATE_RUNNING,),
               timeout_s=timeout_s, what=f"experiment {name} ends", every_s=0.2)
    return client.get(name)


def test_cancelling_a_job_never_submitted_is_nothing_to_cancel(orchestrator) -> None:
    """A trial killed or deleted before its job was submitted: the experiment's loop and
    DeleteExperiment cancel it, and must not fail on the orchestrator's NotFound."""
    jobs = OrchestratorJobs(orchestrator.target, token=TOKENS["writer"])
    try:
        assert jobs.cancel("never-abcdef-t0") == JobView("never-abcdef-t0", "cancelled", "never submitted")
    finally:
        jobs.close()


def test_median_stop_cancels_bad_trials_jobs_and_the_best_is_found(controller, orchestrator, program,
                                                                   platform_settings) -> None:
    with ExperimentClient(controller.target, token=TOKENS["writer"]) as client, \
            JobClient(orchestrator.target, token=TOKENS["admin"]) as jobs:
        created = client.create(experiment_yaml("median", program, max_trials=8, early=True))
        assert created.status.state == pb.EXPERIMENT_STATE_RUNNING
        done = ended(client, "median")
        trials = client.trials("median")
        assert done.status.reason == "MaxTrialsReached" and len(trials) == 8
        stopped = [t for t in trials if t.state == pb.TRIAL_STATE_EARLY_STOPPED]
        good = [t for t in trials if t.state == pb.TRIAL_STATE_SUCCEEDED]
        assert len(good) >= 2, [(t.parameters["x"], t.state) for t in trials]
        slow = [t for t in trials if t.number >= 2 and float(t.parameters["x"]) > 0]
        assert slow and all(t.state == pb.TRIAL_STATE_EARLY_STOPPED for t in slow), slow
        for trial in slow:  # pruned at step 2: its job was cancelled long before its 600 epochs
            job = jobs.get(trial.job_id)
            assert job.status.state == jobs_pb2.JOB_STATE_CANCELLED, trial
            assert job.spec.job_class == jobs_pb2.JOB_CLASS_TE
            assert "pruner" in trial.message
            assert next(m for m in trial.metrics if m.name == "loss").count < 600
        for trial in stopped:  # a quick trial may have ended before its cancel arrived
            assert jobs.get(trial.job_id).status.state in (jobs_pb2.JOB_STATE_CANCELLED, jobs_pb2.JOB_STATE_SUCCEEDED)
        best = done.status.current_optimal_trial
        assert best.objective_value == min(t.objective_value for t in good)
        assert {m.name for m in best.metrics} == {"loss", "accuracy"}
    records = asyncio.run(read_records(platform_settings, EXPERIMENTS.full_name(platform_settings.topic_prefix),
                                       8 * 3 + 3))  # each trial: created, running, ended; the experiment's
    types = [dict(r.headers)["ce_type"].decode() for r in records]
    trial_states = [events_pb2.TrialChanged.FromString(r.value).trial.state for r, t in zip(records, types, strict=True)
                    if t == "opml.automl.v1.TrialChanged"]
    experiments = [events_pb2.ExperimentChanged.FromString(r.value).experiment for r, t in
                   zip(records, types, strict=True) if t == "opml.automl.v1.ExperimentChanged"]
    assert trial_states.count(pb.TRIAL_STATE_EARLY_STOPPED) == len(stopped)
    assert experiments[-1].status.state == pb.EXPERIMENT_STATE_SUCCEEDED and experiments[-1].katib_yaml == ""


def test_goal_reached_ends_early_and_push_metrics(controller, program) -> None:
    with ExperimentClient(controller.target, token=TOKENS["writer"]) as client:
        client.create(experiment_yaml("goal", program, max_trials=12, parallel=1, goal=5.0, mode="push",
                                      collector="Push"))
        done = ended(client, "goal")
        assert done.status.reason == "GoalReached", done.status
        assert done.status.trials < 12
        assert done.status.current_optimal_trial.objective_value <= 5.0


def test_failed_trials_fail_the_experiment_with_the_jobs_error(controller, program) -> None:
    with ExperimentClient(controller.target, token=TOKENS["writer"]) as client:
        client.create(experiment_yaml("fails", program, max_trials=6, parallel=2, mode="fail", max_failed=1))
        done = ended(client, "fails")
        assert done.status.state == pb.EXPERIMENT_STATE_FAILED
        assert done.status.reason == "MaxFailedTrialsReached"
        failed = [t for t in client.trials("fails") if t.state == pb.TRIAL_STATE_FAILED]
        assert len(failed) >= 2 and all(t.message.startswith("job failed:") for t in failed)


def test_sigkilled_controller_finishes_with_no_trial_repeated_or_lost(start_service, controller_env, orchestrator,
                                                                      program) -> None:
    first = start_service("automl-controller", env=controller_env)
    with ExperimentClient(first.target, token=TOKENS["writer"]) as client:
        client.create(experiment_yaml("killed", program, max_trials=6, parallel=3))
        poll_until(lambda: sum(t.state == pb.TRIAL_STATE_RUNNING for t in client.trials("killed")) >= 2,
                   what="two trials running", every_s=0.05)
    first.process.send_signal(signal.SIGKILL)
    first.process.wait()
    second = start_service("automl-controller", env=controller_env)
    with ExperimentClient(second.target, token=TOKENS["writer"]) as client, \
            JobClient(orchestrator.target, token=TOKENS["admin"]) as jobs:
        done = ended(client, "killed")
        trials = client.trials("killed")
        assert done.status.reason == "MaxTrialsReached" and done.status.trials == 6
        assert sorted(t.number for t in trials) == list(range(6))
        assert all(t.state == pb.TRIAL_STATE_SUCCEEDED for t in trials), trials
        ours = jobs.list(labels={"opml.dev/experiment": "killed"})
        assert {j.spec.labels["opml.dev/trial"] for j in ours} == {str(n) for n in range(6)}
        assert sorted(j.status.job_id for j in ours) == sorted(t.job_id for t in trials)  # one job per trial
        assert all(j.status.attempt == 0 and j.status.retries == 0 for j in ours)  # each ran once
        assert len({t.parameters["x"] for t in trials}) == 6


def leader_gauge(env: dict[str, str]) -> float:
    page = samples(scrape(env["OPML_AUTOML_CONTROLLER_METRICS_PORT"]))
    return next(s.value for s in page if s.name == "opml_automl_controller_leader")


def test_a_replica_takes_over_from_a_sigkilled_leader_with_no_trial_repeated_or_lost(
        start_service, controller_env, orchestrator, program) -> None:
    """Two replicas over one Redis: one leads (the lease), the other serves the API. An experiment
    created on the follower is run by the leader; the leader is SIGKILLed mid-experiment (no release:
    the lease expires) and the follower takes over, re-attaching to the running trials' jobs."""
    replicated = {**controller_env, "OPML_AUTOML_CONTROLLER_LEASE_TTL_S": "2", "OPML_AUTOML_CONTROLLER_RESYNC_S": "0.5"}
    own = ("OPML_AUTOML_CONTROLLER_GRPC_PORT", "OPML_AUTOML_CONTROLLER_METRICS_PORT", "OPML_AUTOML_CONTROLLER_HOME")
    fresh = start_service.env("automl-controller")
    replicas = [replicated, {**replicated, **{key: fresh[key] for key in own}}]
    processes = [start_service("automl-controller", env=env) for env in replicas]
    poll_until(lambda: sorted(leader_gauge(env) for env in replicas) == [0.0, 1.0], what="one leader of two")
    leader = next(i for i, env in enumerate(replicas) if leader_gauge(env) == 1.0)
    follower = 1 - leader
    with ExperimentClient(processes[follower].target, token=TOKENS["admin"]) as client:
        client.create(experiment_yaml("replicated", program, max_trials=6, parallel=3))  # on the follower
        poll_until(lambda: sum(t.state == pb.TRIAL_STATE_RUNNING for t in client.trials("replicated")) >= 2,
                   what="two trials running", every_s=0.05)
        with pytest.raises(FailedPrecondition, match="does not lead"):
            client.delete("replicated")  # its loop is the leader's: stop it first
        processes[leader].process.send_signal(signal.SIGKILL)
        processes[leader].process.wait()
        poll_until(lambda: leader_gauge(replicas[follower]) == 1.0, what="the follower leads", timeout_s=30)
        done = ended(client, "replicated")
        trials = client.trials("replicated")
    with JobClient(orchestrator.target, token=TOKENS["admin"]) as jobs:
        assert done.status.reason == "MaxTrialsReached" and done.status.trials == 6
        assert sorted(t.number for t in trials) == list(range(6))
        assert all(t.state == pb.TRIAL_STATE_SUCCEEDED for t in trials), trials
        ours = jobs.list(labels={"opml.dev/experiment": "replicated"})
        assert sorted(j.status.job_id for j in ours) == sorted(t.job_id for t in trials)  # one job per trial
        assert all(j.status.attempt == 0 and j.status.retries == 0 for j in ours)  # each ran once
        assert len({t.parameters["x"] for t in trials}) == 6
    assert "this replica leads" in processes[follower].log_path.read_text()  # each change is logged


def test_validate_reports_every_violation_and_the_cli(controller, program, opml_cli, monkeypatch,
                                                      tmp_path: Path) -> None:
    bad = yaml.safe_load(experiment_yaml("bad", program, max_trials=3, parallel=5))
    bad["spec"]["algorithm"]["algorithmName"] = "pbt"
    with ExperimentClient(controller.target, token=TOKENS["reader"]) as client:
        with pytest.raises(InvalidArgument) as caught:
            client.validate(yaml.safe_dump(bad))
        assert [field for field, _ in caught.value.violations] == ["spec.parallelTrialCount",
                                                                  "spec.algorithm.algorithmName"]
        checked = client.validate(experiment_yaml("ok", program, max_trials=3))
        assert checked.trial_job.job_class == jobs_pb2.JOB_CLASS_TE
        assert any("image" in note for note in checked.notes)
        with pytest.raises(Exception, match="PERMISSION_DENIED|needs the writer|role"):
            client.create(experiment_yaml("ok", program, max_trials=3))
    typo = yaml.safe_load(experiment_yaml("typo", program, max_trials=3))
    typo["spec"]["paralelTrialCount"] = 1
    with ExperimentClient(controller.target, token=TOKENS["admin"]) as client:
        created = client.create(yaml.safe_dump(typo))  # the API's caller hears of the misspelt field too
        assert list(created.warnings) == [
            "spec.paralelTrialCount: unknown field, ignored (did you mean parallelTrialCount?)"]
        assert not client.get("typo").warnings  # said once, at creation
        client.delete("typo")
    monkeypatch.setenv("OPML_AUTOML_CONTROLLER_TARGET", controller.target)
    path = tmp_path / "exp.yaml"
    path.write_text(experiment_yaml("cli", program, max_trials=3, parallel=3))
    assert "valid" in opml_cli("experiment", "validate", "-f", str(path), token="reader")
    assert "created experiments/cli" in opml_cli("experiment", "create", "-f", str(path))
    with ExperimentClient(controller.target, token=TOKENS["reader"]) as client:
        ended(client, "cli")
    assert "cli" in opml_cli("experiment", "ls", token="reader")
    watched = opml_cli("experiment", "trials", "cli", "--watch", token="reader")  # ended: one refresh, then done
    assert "succeeded (MaxTrialsReached) 3/3 trials" in watched and watched.count("succeeded") >= 4
    out = opml_cli("experiment", "best", "cli", "--plot", str(tmp_path / "cli.png"), token="reader")
    assert "best trial" in out and "parameter importances" in out
    assert (tmp_path / "cli.png").read_bytes()[:4] == b"\x89PNG"
    opml_cli("experiment", "delete", "cli", token="writer", expect_exit=1)
    opml_cli("experiment", "delete", "cli", token="admin")
    assert "cli" not in opml_cli("experiment", "ls", token="reader")



def modelling_controller(start_service: ServiceStarter, orchestrator, store, trials_dir: Path) -> tuple:
    """A controller that commits best models to ``store``, and its environment."""
    env = start_service.env("automl-controller", extra_env={
        "OPML_AUTOML_CONTROLLER_JOB_ORCHESTRATOR_TARGET": orchestrator.target,
        "OPML_AUTOML_CONTROLLER_JOB_ORCHESTRATOR_TOKEN": TOKENS["writer"],
        "OPML_AUTOML_CONTROLLER_BUNDLE_STORE_TARGET": store.target,
        "OPML_AUTOML_CONTROLLER_BUNDLE_STORE_TOKEN": TOKENS["writer"],
        "OPML_AUTOML_CONTROLLER_TRIALS_DIR": str(trials_dir)})
    return start_service("automl-controller", env=env), env


ROLLOUT = {"steps": [{"weight": 10}, {"analysis": {"interval_s": 5, "count": 1,
                                                    "checks": {"error_rate": {"max_increase": 0.01}}}}]}
MONITORING = {"window": {"count": 100}, "rules": [{"name": "accuracy-low", "signal": "mpp", "under": 0.8}]}


def test_each_trial_uploads_its_model_with_its_own_grant_and_the_best_is_committed_servable(
        start_service, orchestrator, program, trials_dir: Path, job_dir: Path) -> None:
    """Trials upload their models themselves (the files at the bundle's root, the reference set as
    reference.npz); the controller never reads their folders, reads the best one's bundle back from the
    store and commits it with the experiment's serving files, tags and lineage. The grant reaches the
    trial's process and no reply of the orchestrator, and is revoked once its trial has ended: a grant
    kept past its trial's end (as a leaked env would be) is refused by the bundle-store, UNAUTHENTICATED,
    while the best model, committed with the controller's own token, is there."""
    store = start_service("bundle-store")
    controller, env = modelling_controller(start_service, orchestrator, store, trials_dir)
    model = {"serve": True, "rollout": ROLLOUT, "monitoring": MONITORING, "maxBytes": "1Mi"}
    kept = job_dir / "grants"
    kept.mkdir(mode=0o777)
    kept.chmod(0o777)  # the trials' jobs run as users of their own
    with ExperimentClient(controller.target, token=TOKENS["writer"]) as client:
        client.create(experiment_yaml("modelled", program, max_trials=3, save_model=True, model=model,
                                      keep_grant=kept))
        done = ended(client, "modelled")
        trials = client.trials("modelled")

    def revoked() -> list[float]:
        return [s.value for s in samples(scrape(env["OPML_AUTOML_CONTROLLER_METRICS_PORT"]))
                if s.name == "opml_automl_controller_upload_grant_revocations_total" and s.labels["outcome"] == "revoked"]

    poll_until(lambda: revoked() == [3.0], timeout_s=30, what="the three trials' grants revoked", every_s=0.1)
    for trial in trials:
        with (BundleStoreClient(store.target, token=(kept / trial.job_id).read_text()) as leaked,
              pytest.raises(Unauthenticated, match=r"upload grant [0-9a-f]{16} was revoked")):
            leaked.add("automl", trial.job_id, {"late.bin": b"uploaded after the trial ended"})
    assert done.best_model_bundle.startswith("contexts/automl/bundles/"), done
    best = done.status.current_optimal_trial
    with BundleStoreClient(store.target, token=TOKENS["reader"]) as bundles:
        uploads = {t.job_id: bundles.get_bundle("automl", t.job_id) for t in trials}  # one per trial, its own name
        assert all(not b.committed and b.lineage.creator.startswith("upload-grant:") for b in uploads.values())
        bundle = bundles.get_bundle("automl", done.best_model_bundle.rsplit("/", 1)[1])
        assert bundle.committed and bundle.bundle_name == "modelled-best"
        assert dict(bundle.tags) | {"experiment-uid": "-"} == {
            "kind": "model", "source": "automl-controller", "experiment": "modelled", "experiment-uid": "-",
            "trial": str(best.number), "algorithm": "random", "serve": "true"}
        assert list(bundle.lineage.input_uuids) == [uploads[best.job_id].uuid]
        assert dict(bundle.lineage.parameters)["x"] == best.parameters["x"]
        assert bundle.lineage.code_version == f"jobs/{best.job_id}"
        assert sorted(f.path for f in bundle.files) == ["model.yaml", "monitoring.yaml", "reference.npz",
                                                        "rollout.yaml", "weights.txt"]  # at the root

        def read(path: str) -> bytes:
            return b"".join(bundles.read_file("automl", bundle.uuid, path))

        assert float(read("weights.txt")) == float(best.parameters["x"])
        assert yaml.safe_load(read("rollout.yaml")) == RolloutSpec.from_dict(ROLLOUT).to_dict()
        assert yaml.safe_load(read("monitoring.yaml")) == MONITORING
        with np.load(io.BytesIO(read("reference.npz"))) as reference:
            assert sorted(reference.files) == ["feature.x", "labels", "predicted"] and len(reference["predicted"]) == 64
    with JobClient(orchestrator.target, token=TOKENS["admin"]) as jobs:
        job = jobs.get(best.job_id)
        assert dict(job.spec.secret_env) == {} and job.spec.env["AUTOML_MODEL_BUNDLE"] == best.job_id
        log = b"".join(chunk.data for chunk in jobs.logs(best.job_id)).decode()
    assert "opmlgrant1." not in log and f'"uuid": "{uploads[best.job_id].uuid}"' in log
    assert "opmlgrant1." not in (controller.log_path.read_text() + orchestrator.log_path.read_text())


def test_a_trials_grant_allows_its_own_bundle_only_and_a_best_trial_that_uploaded_nothing_commits_nothing(
        start_service, orchestrator, job_dir: Path, trials_dir: Path) -> None:
    """A trial using its grant on another trial's bundle, the best bundle, another context, a listing,
    a grant of its own: each refused by the bundle-store. It uploaded nothing: no model is committed,
    the experiment's message says why and the metric counts it."""
    store = start_service("bundle-store")
    controller, env = modelling_controller(start_service, orchestrator, store, trials_dir)
    abuser = job_dir / "abuser.py"
    abuser.write_text(GRANT_ABUSER)
    argv = ["${trialParameters.trialName}", "--x=${trialParameters.x}"]
    with ExperimentClient(controller.target, token=TOKENS["writer"]) as client:
        client.create(experiment_yaml("abused", abuser, max_trials=2, parallel=2, max_failed=1, argv=argv,
                                      model={}))
        done = ended(client, "abused")
        trials = {t.number: t for t in client.trials("abused")}
    with JobClient(orchestrator.target, token=TOKENS["admin"]) as jobs:
        for trial in trials.values():
            log = b"".join(chunk.data for chunk in jobs.logs(trial.job_id)).decode()
            assert [line for line in log.splitlines() if "allowed" in line or "refused" in line] == [
                "refused other: PERMISSION_DENIED", "refused best: PERMISSION_DENIED",
                "refused context: PERMISSION_DENIED", "refused list: PERMISSION_DENIED",
                "refused commit: PERMISSION_DENIED", "refused grant: PERMISSION_DENIED"]
    assert done.status.state == pb.EXPERIMENT_STATE_SUCCEEDED and done.best_model_bundle == ""
    assert done.status.message.endswith(
        f"; the best trial's model was refused: the trial uploaded no bundle {trials[0].job_id!r} to "
        f"context 'automl' (does it call opml_automl_controller.sdk.save_model?)")
    with BundleStoreClient(store.target, token=TOKENS["reader"]) as bundles:
        assert bundles.list_bundles("automl") == []
    page = samples(scrape(env["OPML_AUTOML_CONTROLLER_METRICS_PORT"]))
    assert [s.value for s in page if s.name == "opml_automl_controller_models_refused_total"] == [1.0]


KERAS_TRIAL = textwrap.dedent("""
    import os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np, keras
    lr = float(sys.argv[1])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=lr), loss="binary_crossentropy", metrics=["accuracy"])
    model.fit(x, y, epochs=3, batch_size=64, verbose=2)  # unchanged Keras: "... - accuracy: 0.67 - loss: 0.64"
""")


def test_an_unchanged_keras_trial_is_read_with_a_katib_filter(controller, job_dir: Path) -> None:
    program = job_dir / "keras_trial.py"
    program.write_text(KERAS_TRIAL)
    doc = yaml.safe_load(experiment_yaml("keras", program, max_trials=2, parallel=2, max_failed=0))
    container = doc["spec"]["trialTemplate"]["trialSpec"]["spec"]["template"]["spec"]["containers"][0]
    container["command"] = [sys.executable, str(program), "${trialParameters.lr}"]
    container["resources"] = {"requests": {"cpu": "1", "memory": "1Gi"}}
    doc["spec"]["parameters"] = [{"name": "lr", "parameterType": "double",
                                  "feasibleSpace": {"min": "0.01", "max": "0.5", "distribution": "logUniform"}}]
    doc["spec"]["trialTemplate"]["trialParameters"] = [{"name": "lr", "reference": "lr"}]
    doc["spec"]["metricsCollectorSpec"] = {"collector": {"kind": "StdOut"}, "source": {"filter": {
        "metricsFormat": [r"(\w+): ([+-]?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)"]}}}
    with ExperimentClient(controller.target, token=TOKENS["writer"]) as client:
        client.create(yaml.safe_dump(doc))
        done = ended(client, "keras", timeout_s=150)
        trials = client.trials("keras")
    assert done.status.reason == "MaxTrialsReached", done.status
    for trial in trials:
        assert trial.state == pb.TRIAL_STATE_SUCCEEDED, trial
        metrics = {m.name: m for m in trial.metrics}
        assert metrics["loss"].count == 3 and metrics["accuracy"].count == 3  # one per epoch
        assert trial.objective_value == metrics["loss"].min


def test_trials_preempt_a_running_best_effort_job(controller, orchestrator, program, job_dir: Path) -> None:
    """The cluster (8 cores) is full with a BE job; the experiment's TE trials preempt it, run, and the
    BE job resumes afterwards from its checkpoint (its second run ends at once)."""
    started = job_dir / "be-started"
    code = (f"import os, time; open({str(started)!r}, 'a').write(os.environ['OPML_JOB_ATTEMPT']); "
            "os.environ['OPML_JOB_ATTEMPT'] == '0' and time.sleep(120)")
    be = jobs_pb2.JobSpec(name="training-be", job_class=jobs_pb2.JOB_CLASS_BE, command=[sys.executable, "-c", code],
                          checkpoint=jobs_pb2.Checkpoint(dir=str(job_dir / "ckpt"), interval_seconds=1))
    be.roles["worker"].replicas = 1
    be.roles["worker"].resources.cpu_millis = NODE["cpu_millis"]
    with JobClient(orchestrator.target, token=TOKENS["writer"]) as jobs, \
            ExperimentClient(controller.target, token=TOKENS["writer"]) as client:
        jobs.submit(be)
        poll_until(lambda: started.exists(), what="the BE job runs")
        client.create(experiment_yaml("preempting", program, max_trials=2, parallel=2, max_failed=0))
        done = ended(client, "preempting")
        assert done.status.reason == "MaxTrialsReached" and done.status.trials_succeeded == 2
        job = jobs.get("training-be")
        assert job.status.preemptions >= 1, job.status
        finished = poll_until(lambda: (j := jobs.get("training-be")).status.state == jobs_pb2.JOB_STATE_SUCCEEDED
                              and j, what="the BE job resumes and ends", timeout_s=60)
        assert finished.status.attempt >= 1 and started.read_text().startswith("01")


# A small Keras model (logistic regression on 4 features), unchanged by the collector but for Push's report
# call: trials 0 and 1 are good so the median rule has its 2 completed trials; from trial 2 on a trial with
# x > 0 is bad (its labels are noise: its loss stays near 0.69 while good trials learn) and slow (0.5 s an
# epoch, as a large data set) and would train for 2000 epochs unless stopped. Optuna's MedianPruner compares
# a trial with the completed trials at the same step, so a trial past their last step (5) can no longer be
# stopped: the seeds make trial 2, which starts beside trials 0 and 1, a good one, and a bad trial's slow
# epochs leave the completed trials time to be there before it reaches step 5.
KERAS_MEDIAN_TRIAL = textwrap.dedent("""
    import argparse, os, time
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    p = argparse.ArgumentParser()
    p.add_argument("--x", type=float)
    p.add_argument("--mode")
    p.add_argument("--name")
    a = p.parse_args()
    import numpy as np, keras
    number = int(a.name.rsplit("-t", 1)[1])
    bad = a.x > 0 and number >= 2
    rng = np.random.default_rng(number)
    x = rng.normal(size=(256, 4)).astype("float32")
    y = rng.integers(0, 2, size=256).astype("float32") if bad else (x.sum(axis=1) > 0).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss="binary_crossentropy", metrics=["accuracy"])
    callbacks = [keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: time.sleep(0.5))] if bad else []
    if a.mode == "push":
        from opml_automl_controller.sdk import report
        callbacks.append(keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: report(loss=logs["loss"], accuracy=logs["accuracy"])))
    model.fit(x, y, epochs=2000 if bad else 5, batch_size=32, verbose=2 if a.mode == "stdout" else 0,
              callbacks=callbacks, validation_split=0.25 if a.mode == "trace" else 0.0)
""")
KERAS_LINE = r"(\w+): ([+-]?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)"  # Keras's verbose=2 "... - accuracy: 0.67 - loss: 0.64"


def keras_median_yaml(name: str, program: Path, *, kind: str, max_trials: int, seed: int) -> str:
    doc = yaml.safe_load(experiment_yaml(name, program, max_trials=max_trials, parallel=3, early=True,
                                         max_failed=0, collector=kind))
    doc["spec"]["algorithm"]["algorithmSettings"] = [{"name": "random_state", "value": str(seed)}]
    if kind == "Trace":
        doc["spec"]["objective"]["additionalMetricNames"] = ["accuracy", "val_loss"]
    container = doc["spec"]["trialTemplate"]["trialSpec"]["spec"]["template"]["spec"]["containers"][0]
    container["command"] = [sys.executable, str(program), "--x=${trialParameters.x}", f"--mode={kind.lower()}",
                            "--name=${trialParameters.trialName}"]
    if kind == "StdOut":
        doc["spec"]["metricsCollectorSpec"]["source"] = {"filter": {"metricsFormat": [KERAS_LINE]}}
    return yaml.safe_dump(doc)


def test_keras_median_stop_with_stdout_push_and_trace_collectors(controller, orchestrator, job_dir: Path) -> None:
    """Issue 13's must-show: 12 Keras trials, 3 in parallel, medianstop, metrics from the tracer (Trace);
    the same with 4 trials read from stdout (StdOut) and from the SDK (Push). Bad trials end
    EARLY_STOPPED at once, their TE jobs cancelled long before their 2000 epochs."""
    program = job_dir / "keras_median.py"
    program.write_text(KERAS_MEDIAN_TRIAL)
    runs = {"trace": ("Trace", 12, 7), "stdout": ("StdOut", 4, 5), "push": ("Push", 4, 11)}  # bad: 3-6, 10, 11 / 3 / 3
    with ExperimentClient(controller.target, token=TOKENS["writer"]) as client, \
            JobClient(orchestrator.target, token=TOKENS["admin"]) as jobs:
        for name, (kind, max_trials, seed) in runs.items():
            client.create(keras_median_yaml(name, program, kind=kind, max_trials=max_trials, seed=seed))
        for name, (kind, max_trials, _) in runs.items():
            done = ended(client, name, timeout_s=400)
            trials = client.trials(name)
            assert done.status.reason == "MaxTrialsReached" and len(trials) == max_trials, (name, done.status)
            bad = [t for t in trials if t.number >= 2 and float(t.parameters["x"]) > 0]
            succeeded = [t for t in trials if t.state == pb.TRIAL_STATE_SUCCEEDED]
            assert bad and len(succeeded) >= 2, (name, [(t.number, t.parameters["x"], t.state) for t in trials])
            for trial in succeeded:
                metrics = {m.name: m for m in trial.metrics}
                assert metrics["loss"].count == 5 and metrics["accuracy"].count == 5, (name, trial)  # one per epoch
                assert trial.objective_value == metrics["loss"].min
                if kind == "Trace":
                    assert metrics["val_loss"].count == 5
            for trial in bad:
                assert trial.state == pb.TRIAL_STATE_EARLY_STOPPED and "pruner" in trial.message, (name, trial)
                job = jobs.get(trial.job_id)
                assert job.status.state == jobs_pb2.JOB_STATE_CANCELLED, (name, trial)
                assert job.spec.job_class == jobs_pb2.JOB_CLASS_TE and job.spec.trace == (kind == "Trace")
                assert next(m for m in trial.metrics if m.name == "loss").count < 2000
            for trial in trials:  # the median rule may stop good trials below the median too
                assert trial.state in (pb.TRIAL_STATE_SUCCEEDED, pb.TRIAL_STATE_EARLY_STOPPED), (name, trial)
                if trial.state == pb.TRIAL_STATE_EARLY_STOPPED:  # a quick one may have ended before its cancel
                    assert jobs.get(trial.job_id).status.state in (jobs_pb2.JOB_STATE_CANCELLED,
                                                                   jobs_pb2.JOB_STATE_SUCCEEDED)
            best = done.status.current_optimal_trial
            assert best.objective_value == min(t.objective_value for t in succeeded)
