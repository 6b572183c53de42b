"""The Kubernetes executor without a cluster (none runs here).

Its manifests are validated offline against the Kubernetes 1.37 API schema (kubernetes-validate,
strict), and its API calls run against ``FakeCoreV1Api``, an in-memory stand-in for the client's
``CoreV1Api`` whose kubelet each test drives by hand: pods start, exit, are evicted or vanish.
This checks how the executor reads pod states and applies TonY's rules; it cannot show that a real
API server or kubelet behaves as the fake does.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound
from opml_job_orchestrator.executor import JobOutcome, JobProgram, TaskEvent, TaskState
from opml_job_orchestrator.executor.fake_kubernetes import FakeCoreV1Api
from opml_job_orchestrator.executor.kubernetes import (
    WORK_DIR,
    KubernetesExecutor,
    label_value,
    pod_name,
    render_run,
    run_name,
    secret_name,
)
from opml_job_orchestrator.scheduler import JobClass, JobSpec, Resources, RoleSpec

CPU = Resources(cpu_millis=500, memory_mib=1024)
GPU = Resources(cpu_millis=4000, memory_mib=16384, gpu=2)
PROGRAM = JobProgram(commands={role: ["python", "train.py", "--role", role]
                               for role in ("chief", "worker", "ps", "evaluator")},
                     env={"EPOCHS": "3"}, checkpoint_dir="/ckpt/mnist")


def spec(job_id: str = "mnist", resources: Resources = CPU, **replicas: int) -> JobSpec:
    return JobSpec(job_id=job_id, job_class=JobClass.BE,
                   roles={role: RoleSpec(n, resources) for role, n in (replicas or {"worker": 1}).items()})


def placement(job: JobSpec) -> dict[str, tuple[str, ...]]:
    return {role: tuple(f"node-{i}" for i in range(s.replicas)) for role, s in job.roles.items()}


def validate(objects: list[dict]) -> None:
    for obj in objects:
        kubernetes_validate.validate(obj, "1.37.0", strict=True)


def env_of(pod: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}


def test_chief_workers_ps_evaluator_render_to_valid_services_and_pods() -> None:
    job = spec(chief=1, worker=2, ps=1, evaluator=1)
    objects = render_run(job, PROGRAM, placement(job), attempt=3, image="registry.local/mnist:1", namespace="ml")
    validate(objects)
    base = run_name("mnist", 3)
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    pods = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Pod"}
    assert sorted(services) == sorted(f"{base}-{r}" for r in ("chief", "worker", "ps", "evaluator"))
    assert all(s["spec"]["clusterIP"] == "None" for s in services.values())  # headless: DNS names per pod
    assert len(pods) == 5

    chief = pods[pod_name("mnist", 3, "chief", 0)]
    assert chief["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "opml-job-orchestrator",
                                           "opml.io/job": "mnist", "opml.io/attempt": "3", "opml.io/role": "chief",
                                           "opml.io/index": "0"}
    assert chief["spec"]["restartPolicy"] == "Never"
    assert (chief["spec"]["hostname"], chief["spec"]["subdomain"]) == ("chief-0", f"{base}-chief")
    assert chief["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "node-0"}
    assert chief["spec"]["containers"][0]["command"] == ["python", "train.py", "--role", "chief"]
    assert chief["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "500m", "memory": "1024Mi"},
                                                           "limits": {"memory": "1024Mi"}}
    worker1 = pods[pod_name("mnist", 3, "worker", 1)]
    assert worker1["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "node-1"}
    env = env_of(worker1)
    assert (env["OPML_JOB_ID"], env["OPML_JOB_ATTEMPT"], env["OPML_TASK_TYPE"], env["OPML_TASK_INDEX"]) == (
        "mnist", "3", "worker", "1")
    assert (env["OPML_CHECKPOINT_DIR"], env["EPOCHS"]) == ("/ckpt/mnist", "3")
    tf_config = json.loads(env["TF_CONFIG"])
    assert tf_config["task"] == {"type": "worker", "index": 1}
    assert tf_config["cluster"] == {
        "chief": [f"chief-0.{base}-chief.ml.svc:2222"],
        "worker": [f"worker-0.{base}-worker.ml.svc:2222", f"worker-1.{base}-worker.ml.svc:2222"],
        "ps": [f"ps-0.{base}-ps.ml.svc:2222"],
    }  # the evaluator is left out, as TensorFlow requires
    assert all(json.loads(env_of(p)["TF_CONFIG"])["cluster"] == tf_config["cluster"] for p in pods.values())
    evaluator = pods[pod_name("mnist", 3, "evaluator", 0)]
    assert "ports" not in evaluator["spec"]["containers"][0]


def test_every_pod_is_sandboxed_non_root_read_only_no_capabilities_no_token() -> None:
    job = spec(chief=1, worker=2)
    objects = render_run(job, PROGRAM, placement(job), attempt=0, image="img", namespace="ml", run_as_user=4242)
    validate(objects)
    for pod in (o for o in objects if o["kind"] == "Pod"):
        assert pod["spec"]["securityContext"] == {"runAsNonRoot": True, "runAsUser": 4242, "runAsGroup": 4242,
                                                  "fsGroup": 4242, "seccompProfile": {"type": "RuntimeDefault"}}
        assert pod["spec"]["automountServiceAccountToken"] is False and "serviceAccountName" not in pod["spec"]
        container = pod["spec"]["containers"][0]
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                                "capabilities": {"drop": ["ALL"]}}
        # the root filesystem is read-only: the working directory, HOME and /tmp are the pod's own emptyDirs
        assert pod["spec"]["volumes"] == [{"name": "work", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
        assert container["volumeMounts"] == [{"name": "work", "mountPath": WORK_DIR},
                                             {"name": "tmp", "mountPath": "/tmp"}]
        assert container["workingDir"] == WORK_DIR
        assert (env_of(pod)["HOME"], env_of(pod)["TMPDIR"]) == (WORK_DIR, "/tmp")


def test_gpu_job_with_a_checkpoint_volume_and_tracing_renders_valid_pods() -> None:
    job = spec("resnet", GPU, worker=2)
    program = JobProgram(commands={"worker": ["python", "train.py"]}, checkpoint_dir="/ckpt", trace=True)
    objects = render_run(job, program, placement(job), attempt=0, image="img", namespace="default",
                         port=5000, node_label=None, checkpoint_claim="checkpoints")
    validate(objects)
    pod = next(o for o in objects if o["kind"] == "Pod")
    container = pod["spec"]["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "4000m", "memory": "16384Mi", "nvidia.com/gpu": "2"},
                                      "limits": {"memory": "16384Mi", "nvidia.com/gpu": "2"}}
    assert "nodeSelector" not in pod["spec"]
    assert pod["spec"]["volumes"][-1] == {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "checkpoints"}}
    assert container["volumeMounts"][-1] == {"name": "checkpoints", "mountPath": "/ckpt"}
    assert container["command"] == ["python", "-m", "opml_trace_collector.inject.run", "--job", "resnet",
                                    "--worker", "worker-0", "--", "python", "train.py"]
    assert container["ports"] == [{"name": "tf", "containerPort": 5000}]


def test_long_and_dotted_job_ids_become_valid_names_and_labels() -> None:
    job_id = "team.vision_" + "x" * 100 + "."
    job = spec(job_id, chief=1, evaluator=1)
    objects = render_run(job, PROGRAM, placement(job), attempt=12345, image="img", namespace="default")
    validate(objects)
    assert len(label_value(job_id)) <= 63 and label_value(job_id) != label_value(job_id[:-1] + "y")
    assert all(o["metadata"]["annotations"]["opml.io/job-id"] == job_id for o in objects)
    assert all(len(o["metadata"]["name"]) <= 63 for o in objects if o["kind"] == "Service")


# -- the executor against the fake API -----------------------------------------------------------


@pytest.fixture
def api() -> FakeCoreV1Api:
    return FakeCoreV1Api()


@pytest.fixture
async def executor(api: FakeCoreV1Api, tmp_path: Path) -> AsyncIterator[KubernetesExecutor]:
    async with KubernetesExecutor(image="img", log_dir=tmp_path / "logs", api=api, poll_interval_s=0.02,
                                  cleanup_grace_s=7, shutdown_grace_s=1, delete_timeout_s=1) as ex:
        yield ex


async def test_chief_success_ends_the_run_without_awaiting_ps_and_keeps_the_logs(
        executor: KubernetesExecutor, api: FakeCoreV1Api, tmp_path: Path, until_job_event, job_event,
        task_states) -> None:
    job = spec(chief=1, worker=1, ps=1)
    await executor.launch(job, PROGRAM, placement(job), attempt=0)
    assert len(api.pods) == 3 and len(api.services) == 3
    assert await executor.poll(0) == []  # pending pods: nothing yet
    names = {r: pod_name("mnist", 0, r, 0) for r in ("chief", "worker", "ps")}
    for name in names.values():
        api.set_running(name)
        api.write_log(name, f"hello from {name}\n")
    assert task_states(await executor.poll(1)) == {k: [TaskState.RUNNING]
                                                   for k in [("chief", 0), ("worker", 0), ("ps", 0)]}
    assert f"hello from {names['ps']}" in await executor.logs("mnist", "ps", 0)  # the live pod's log
    api.set_exited(names["chief"], 0)
    events = await until_job_event(executor, "mnist")
    assert task_states(events) == {("chief", 0): [TaskState.SUCCEEDED], ("worker", 0): [TaskState.STOPPED],
                                   ("ps", 0): [TaskState.STOPPED]}
    assert job_event(events).outcome is JobOutcome.SUCCEEDED and events[-1] == job_event(events)
    assert not api.pods and not api.services
    assert sorted(api.deletions) == sorted((n, 7) for n in names.values())  # cleanup_grace_s
    assert f"hello from {names['chief']}" in await executor.logs("mnist", "chief", 0)  # kept after deletion
    assert (tmp_path / "logs" / "mnist" / "attempt-0" / "worker-0.log").exists()


async def test_a_failed_container_fails_the_run_retriably_with_its_exit_code(
        executor: KubernetesExecutor, api: FakeCoreV1Api, until_job_event, job_event, task_states) -> None:
    job = spec(worker=2)
    await executor.launch(job, PROGRAM, placement(job), attempt=1)
    api.set_running(pod_name("mnist", 1, "worker", 0))
    api.set_exited(pod_name("mnist", 1, "worker", 1), 137, reason="OOMKilled")
    events = await until_job_event(executor, "mnist")
    event = job_event(events)
    assert (event.outcome, event.retriable, event.attempt) == (JobOutcome.FAILED, True, 1)
    assert event.message == "worker 1 exited with code 137 (OOMKilled)"
    failed = [e for e in events if isinstance(e, TaskEvent) and e.state is TaskState.FAILED]
    assert [(e.index, e.exit_code) for e in failed] == [(1, 137)]
    assert task_states(events)[("worker", 1)] == [TaskState.RUNNING, TaskState.FAILED]  # RUNNING always comes first
    assert task_states(events)[("worker", 0)] == [TaskState.RUNNING, TaskState.STOPPED]


@pytest.mark.parametrize("how", ["evict", "vanish"])
async def test_an_evicted_or_vanished_pod_is_lost(
        executor: KubernetesExecutor, api: FakeCoreV1Api, how: str, until_job_event, job_event, task_states) -> None:
    job = spec(worker=1)
    await executor.launch(job, PROGRAM, placement(job), attempt=0)
    name = pod_name("mnist", 0, "worker", 0)
    api.set_running(name)
    await executor.poll(1)
    getattr(api, how)(name)
    events = await until_job_event(executor, "mnist")
    assert task_states(events) == {("worker", 0): [TaskState.LOST]}
    event = job_event(events)
    assert event.outcome is JobOutcome.FAILED and event.retriable
    assert ("Evicted" if how == "evict" else "vanished") in event.message


class _SlowCreates(FakeCoreV1Api):
    """An API server taking its time: creating a pod says so (``creating``), then waits for ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.creating, self.release = threading.Event(), threading.Event()

    def create_namespaced_pod(self, namespace: str, body: dict) -> object:
        self.creating.set()
        self.release.wait()
        return super().create_namespaced_pod(namespace, body)


async def test_a_pod_still_being_created_when_the_pods_are_listed_is_not_lost(
        tmp_path: Path, until_job_event, job_event, task_states) -> None:
    """The orchestrator polls while it launches: a listing taken before a pod exists says nothing of it."""
    api = _SlowCreates()
    async with KubernetesExecutor(image="img", log_dir=tmp_path / "logs", api=api, poll_interval_s=0.02,
                                  shutdown_grace_s=1, delete_timeout_s=1) as executor:
        job = spec(worker=1)
        launching = asyncio.create_task(executor.launch(job, PROGRAM, placement(job), attempt=0))
        try:
            assert await asyncio.to_thread(api.creating.wait, 30)
            assert await executor.poll(0) == []  # listed while the pod is being created
        finally:
            api.release.set()
            await launching
        name = pod_name("mnist", 0, "worker", 0)
        api.set_running(name)
        api.set_exited(name, 0)
        events = await until_job_event(executor, "mnist")
    assert task_states(events) == {("worker", 0): [TaskState.RUNNING, TaskState.SUCCEEDED]}
    assert job_event(events).outcome is JobOutcome.SUCCEEDED


async def test_a_pod_that_cannot_start_fails_the_run_for_good(
        executor: KubernetesExecutor, api: FakeCoreV1Api, until_job_event, job_event) -> None:
    job = spec(worker=1)
    await executor.launch(job, PROGRAM, placement(job), attempt=0)
    api.set_waiting(pod_name("mnist", 0, "worker", 0), "InvalidImageName", 'invalid image "img:"')
    event = job_event(await until_job_event(executor, "mnist"))
    assert event.outcome is JobOutcome.FAILED and not event.retriable
    assert "InvalidImageName" in event.message


@pytest.mark.parametrize(("status", "retriable"), [(422, False), (503, True)])
async def test_a_rejected_object_fails_the_run(executor: KubernetesExecutor, api: FakeCoreV1Api,
                                               status: int, retriable: bool, until_job_event, job_event) -> None:
    job = spec(chief=1, worker=1)
    api.reject[pod_name("mnist", 0, "worker", 0)] = ApiException(status=status, reason="Nope")
    await executor.launch(job, PROGRAM, placement(job), attempt=0)
    events = await until_job_event(executor, "mnist")
    event = job_event(events)
    assert event.outcome is JobOutcome.FAILED and event.retriable is retriable
    assert f"creating pod {pod_name('mnist', 0, 'worker', 0)} failed: {status} Nope" in event.message
    assert not api.pods and not api.services  # the chief created before it is cleaned up


async def test_terminate_deletes_pods_with_the_grace_period(
        executor: KubernetesExecutor, api: FakeCoreV1Api, job_event, task_states) -> None:
    job = spec(worker=2)
    await executor.launch(job, PROGRAM, placement(job), attempt=0)
    for i in (0, 1):
        api.set_running(pod_name("mnist", 0, "worker", i))
    await executor.poll(1)
    with pytest.raises(FailedPrecondition, match="still runs attempt 0"):
        await executor.launch(job, PROGRAM, placement(job), attempt=1)
    await executor.terminate("mnist", 30)
    assert sorted(api.deletions) == [(pod_name("mnist", 0, "worker", i), 30) for i in (0, 1)]
    events = await executor.poll(0)
    assert task_states(events) == {("worker", 0): [TaskState.STOPPED], ("worker", 1): [TaskState.STOPPED]}
    assert job_event(events).outcome is JobOutcome.STOPPED
    with pytest.raises(NotFound, match="never launched"):
        await executor.terminate("other", 1)


async def test_a_restarted_executor_readopts_running_pods(
        api: FakeCoreV1Api, tmp_path: Path, until_job_event, job_event, task_states) -> None:
    job = spec(chief=1, worker=1)
    first = KubernetesExecutor(image="img", log_dir=tmp_path / "logs", api=api, poll_interval_s=0.02)
    await first.start()
    await first.launch(job, PROGRAM, placement(job), attempt=2)
    api.set_running(pod_name("mnist", 2, "chief", 0))
    api.set_running(pod_name("mnist", 2, "worker", 0))
    # the orchestrator crashes: `first` is never stopped, its pods go on
    async with KubernetesExecutor(image="img", log_dir=tmp_path / "logs", api=api, poll_interval_s=0.02,
                                  delete_timeout_s=1) as second:
        where = {"chief": ("node-0",), "worker": ("node-0",)}  # the pods' spec.nodeName
        assert await second.recover("mnist", 2) == where
        assert await second.recover("mnist", 2) == where  # already tracked: nothing to do
        assert task_states(await second.poll(1)) == {("chief", 0): [TaskState.RUNNING],
                                                     ("worker", 0): [TaskState.RUNNING]}
        api.set_exited(pod_name("mnist", 2, "chief", 0), 0)
        event = job_event(await until_job_event(second, "mnist"))
        assert (event.outcome, event.attempt) == (JobOutcome.SUCCEEDED, 2)
        assert await second.recover("gone", 0) is None  # nothing left of that run
        event = job_event(await second.poll(0))
        assert (event.outcome, event.retriable) == (JobOutcome.STOPPED, True)
        with pytest.raises(InvalidArgument, match=r"^attempt: "):
            await second.recover("mnist", -1)


async def test_logs_errors_and_settings(executor: KubernetesExecutor, api: FakeCoreV1Api) -> None:
    with pytest.raises(NotFound, match="never launched"):
        await executor.logs("nope", "worker", 0)
    job = spec(worker=1)
    await executor.launch(job, PROGRAM, placement(job), attempt=0)
    assert await executor.logs("mnist", "worker", 0) == ""  # not started yet
    with pytest.raises(NotFound, match="no task 'worker' 5"):
        await executor.logs("mnist", "worker", 5)
    with pytest.raises(InvalidArgument, match=r"^image: "):
        KubernetesExecutor(image="", log_dir="x")
    with pytest.raises(InvalidArgument, match=r"^port: .* but got 0"):
        KubernetesExecutor(image="i", log_dir="x", port=0)
    with pytest.raises(InvalidArgument, match=r"^poll_interval_s: "):
        KubernetesExecutor(image="i", log_dir="x", poll_interval_s=0)


async def test_stop_ends_every_run(api: FakeCoreV1Api, tmp_path: Path, job_event) -> None:
    ex = KubernetesExecutor(image="img", log_dir=tmp_path / "logs", api=api, poll_interval_s=0.02,
                            shutdown_grace_s=3, delete_timeout_s=1)
    await ex.start()
    job = spec(worker=1)
    await ex.launch(job, PROGRAM, placement(job), attempt=0)
    await ex.stop()
    await ex.stop()
    assert job_event(await ex.poll(0)).outcome is JobOutcome.STOPPED
    assert api.deletions == [(pod_name("mnist", 0, "worker", 0), 3)] and not api.pods


async def test_release_leaves_the_pods_going_for_another_executor_to_readopt(api: FakeCoreV1Api,
                                                                             tmp_path: Path) -> None:
    """A replica that stops leading releases its executor: its successor's re-adopts the pods."""
    ex = KubernetesExecutor(image="img", log_dir=tmp_path / "logs", api=api, poll_interval_s=0.02,
                            shutdown_grace_s=3, delete_timeout_s=1)
    await ex.start()
    job = spec(worker=1)
    await ex.launch(job, PROGRAM, placement(job), attempt=0)
    api.set_running(pod_name("mnist", 0, "worker", 0))
    await ex.release()
    assert not ex.running and not api.deletions and pod_name("mnist", 0, "worker", 0) in api.pods
    async with KubernetesExecutor(image="img", log_dir=tmp_path / "logs", api=api, poll_interval_s=0.02) as successor:
        assert await successor.recover("mnist", 0) == {"worker": ("node-0",)}


async def test_poll_survives_an_api_outage(executor: KubernetesExecutor, api: FakeCoreV1Api,
                                           monkeypatch: pytest.MonkeyPatch, task_states) -> None:
    job = spec(worker=1)
    await executor.launch(job, PROGRAM, placement(job), attempt=0)
    real_list = api.list_namespaced_pod

    def unavailable(*args: object, **kwargs: object) -> None:
        raise ApiException(status=503, reason="Service Unavailable")

    monkeypatch.setattr(api, "list_namespaced_pod", unavailable)
    assert await executor.poll(0.1) == []
    monkeypatch.setattr(api, "list_namespaced_pod", real_list)
    api.set_running(pod_name("mnist", 0, "worker", 0))
    assert task_states(await executor.poll(1)) == {("worker", 0): [TaskState.RUNNING]}


EXAMPLE = Path(__file__).resolve().parents[3] / "deploy" / "k8s" / "examples" / "tf-job.yaml"


def test_the_example_manifest_is_what_the_executor_renders() -> None:
    """deploy/k8s/examples/tf-job.yaml shows users what a job becomes; regenerate it with
    ``OPML_UPDATE_EXAMPLES=1 pytest services/job-orchestrator/tests/test_executor_kubernetes.py -k example``."""
    job = JobSpec(job_id="mnist-dist", job_class=JobClass.BE, checkpoint_interval_s=600,
                  roles={"chief": RoleSpec(1, GPU), "worker": RoleSpec(2, GPU), "ps": RoleSpec(1, CPU),
                         "evaluator": RoleSpec(1, CPU)})
    program = JobProgram(commands={role: ["python", "-m", "trainer.mnist"] for role in job.roles},
                         env={"EPOCHS": "10"}, checkpoint_dir="/checkpoints/mnist-dist")
    objects = render_run(job, program, {"chief": ["gpu-node-0"], "worker": ["gpu-node-0", "gpu-node-1"],
                                        "ps": ["cpu-node-0"], "evaluator": ["cpu-node-0"]},
                         attempt=0, image="registry.example.com/trainer:1.0", namespace="ml",
                         checkpoint_claim="checkpoints")
    validate(objects)
    header = ("# What the job orchestrator's KubernetesExecutor creates for one run of a job with a chief, two\n"
              "# GPU workers, a parameter server and an evaluator (generated by render_run; see the test\n"
              "# test_the_example_manifest_is_what_the_executor_renders). Not applied by hand: the executor\n"
              "# creates and deletes these objects itself.\n")
    text = header + yaml.safe_dump_all(objects, sort_keys=False, width=120)
    if os.environ.get("OPML_UPDATE_EXAMPLES"):
        EXAMPLE.parent.mkdir(parents=True, exist_ok=True)
        EXAMPLE.write_text(text)
    assert EXAMPLE.read_text() == text, "the example is stale: regenerate it (see this test's docstring)"


@pytest.mark.parametrize("example", sorted(EXAMPLE.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_example_manifests_match_the_api_schema(example: Path) -> None:
    documents = [d for d in yaml.safe_load_all(example.read_text()) if d]
    assert documents
    validate(documents)


async def test_recover_reports_where_the_pods_run_and_ends_a_run_it_cannot_place(api: FakeCoreV1Api,
                                                                                 tmp_path: Path, job_event) -> None:
    job = spec(worker=2)
    first = KubernetesExecutor(image="img", log_dir=tmp_path / "logs", api=api, poll_interval_s=0.02)
    await first.start()
    await first.launch(job, PROGRAM, placement(job), attempt=0)
    api.set_running(pod_name("mnist", 0, "worker", 0))  # bound: the fake kubelet's node-0
    # worker 1 still waits to be scheduled: it is pinned to node-1 by its nodeSelector
    await first.launch(spec("broken", worker=2), PROGRAM, placement(spec("broken", worker=2)), attempt=1)
    api.vanish(pod_name("broken", 1, "worker", 1))
    async with KubernetesExecutor(image="img", log_dir=tmp_path / "logs", api=api, poll_interval_s=0.02,
                                  delete_timeout_s=1) as second:
        assert await second.recover("mnist", 0) == {"worker": ("node-0", "node-1")}
        assert await second.recover("broken", 1) is None  # a pod is gone: the run cannot be counted anywhere
        event = job_event(await second.poll(0))
        assert (event.job_id, event.outcome, event.retriable) == ("broken", JobOutcome.STOPPED, True)
        assert "worker 1" in event.message and not [p for p in api.pods if "broken" in p]
    async with KubernetesExecutor(image="img", log_dir=tmp_path / "logs", api=api, node_label=None,
                                  poll_interval_s=0.02, delete_timeout_s=1) as unpinned:
        assert await unpinned.recover("mnist", 0) is None  # worker 1 is on no node, and pinned to none


def test_pods_get_the_service_account_the_platform_env_and_the_secret() -> None:
    job = spec(worker=1)
    program = JobProgram(commands={"worker": ["python", "train.py"]}, env={"OPML_TOPIC_PREFIX": "mine-"}, trace=True)
    objects = render_run(job, program, placement(job), attempt=0, image="img", namespace="ml",
                         service_account="trainer", env_from_secret="opml-platform",
                         platform_env={"OPML_KAFKA_BOOTSTRAP": "kafka:9092", "OPML_TOPIC_PREFIX": "prod-"})
    validate(objects)
    pod = objects[-1]
    assert pod["spec"]["serviceAccountName"] == "trainer"
    assert pod["spec"]["automountServiceAccountToken"] is True  # given to jobs on purpose: its token is theirs
    container = pod["spec"]["containers"][0]
    assert container["envFrom"] == [{"secretRef": {"name": "opml-platform"}}]
    env = env_of(pod)
    assert env["OPML_KAFKA_BOOTSTRAP"] == "kafka:9092" and env["OPML_TOPIC_PREFIX"] == "mine-"  # the job's own wins
    assert container["command"][:3] == ["python", "-m", "opml_trace_collector.inject.run"]


async def test_logs_from_an_offset(executor: KubernetesExecutor, api: FakeCoreV1Api) -> None:
    job = spec(worker=1)
    await executor.launch(job, PROGRAM, placement(job), attempt=0)
    name = pod_name("mnist", 0, "worker", 0)
    api.set_running(name)
    api.write_log(name, "héllo\n")
    assert await executor.logs("mnist", "worker", 0, offset=3) == "llo\n"  # bytes: é is two
    api.write_log(name, "world\n")
    await executor.terminate("mnist", 0)  # the log is copied, then read from the copy
    assert await executor.logs("mnist", "worker", 0, offset=len("héllo\n".encode())) == "world\n"
    with pytest.raises(InvalidArgument, match=r"^offset: "):
        await executor.logs("mnist", "worker", 0, offset=-1)


async def test_a_secret_env_goes_into_a_secret_of_the_run_never_a_pod_spec_and_goes_with_the_run(
        executor: KubernetesExecutor, api: FakeCoreV1Api, until_job_event, job_event) -> None:
    job = spec(worker=2)
    program = JobProgram(commands={"worker": ["python", "train.py"]}, env={"EPOCHS": "3"},
                         secret_env={"GRANT": "secret-grant-7d1"})
    objects = render_run(job, program, placement(job), attempt=0, image="img", namespace="ml",
                         env_from_secret="opml-platform")
    validate(objects)
    secret, pods = objects[0], [o for o in objects if o["kind"] == "Pod"]
    assert (secret["kind"], secret["metadata"]["name"], secret["stringData"]) == (
        "Secret", secret_name("mnist", 0), {"GRANT": "secret-grant-7d1"})  # created before the pods
    for pod in pods:
        assert pod["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": "opml-platform"}},
                                                          {"secretRef": {"name": secret_name("mnist", 0)}}]
        assert "secret-grant-7d1" not in json.dumps(pod) and env_of(pod)["EPOCHS"] == "3"
    assert "secret-grant-7d1" not in repr(program)
    await executor.launch(job, program, placement(job), attempt=0)
    assert list(api.secrets) == [secret_name("mnist", 0)]
    for i in (0, 1):
        api.set_running(pod_name("mnist", 0, "worker", i))
        api.set_exited(pod_name("mnist", 0, "worker", i), 0)
    assert job_event(await until_job_event(executor, "mnist")).outcome is JobOutcome.SUCCEEDED
    assert not api.pods and not api.secrets  # deleted with the run
