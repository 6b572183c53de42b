"""Runs every task of a job as a Kubernetes pod, through the official ``kubernetes`` client.

Per run, :func:`render_run` (a pure function) makes one headless Service per role and one Pod
per replica. Each pod's ``hostname`` (``worker-1``) and ``subdomain`` (its role's Service) give
it a stable DNS name, ``worker-1.<run>-worker.<namespace>.svc``, which is what TF_CONFIG lists,
so every task knows every address before any pod is scheduled.

Why bare Pods (``restartPolicy: Never``) rather than a Job or an indexed Job: every decision a
Job controller would make is the orchestrator's here. A Job restarts failed pods itself
(``backoffLimit``), while our retries must come from the orchestrator with backoff, a new
``attempt`` and a resume from the checkpoint; a Job waits for all its pods, while TonY's rule
ends the run when the chief exits and never waits for parameter servers; and gang placement on
the scheduler's chosen nodes is ours too. A Pod reports exactly what the rules need (phase,
exit code, eviction), and deleting it with a grace period is the SIGTERM-then-kill a
preemption needs.

Each pod is labelled ``opml.io/job``, ``opml.io/attempt``, ``opml.io/role``, ``opml.io/index``;
:meth:`KubernetesExecutor.poll` lists the executor's pods by label and turns what changed into
events with :class:`~opml_job_orchestrator.executor.tony.RunTracker`, the rules the local
executor uses. When a run ends, its pods' logs are copied to ``log_dir`` (deleting a pod deletes
its log), then its pods and Services are deleted.

No Kubernetes cluster runs where this was written. The manifests are checked offline against
the Kubernetes API schema (kubernetes-validate), and the API-calling part is tested only
against :class:`~opml_job_orchestrator.executor.fake_kubernetes.FakeCoreV1Api`, an in-memory
stand-in for ``CoreV1Api`` that returns the client's own model objects; it has not run against
a real API server. Not done here: heartbeats and checkpoint reports (``OPML_HEARTBEAT_FILE`` is a
local-executor feature; a pod's liveness is the kubelet's).

Pods get the platform's non-secret settings (``platform_env``: the broker, topic prefix, S3
endpoint... that the trace collector's tracer reads) as plain variables, and the jobs' own scoped
credentials (a bucket-limited S3 identity, a read-only Redis user; never the platform's) from a
Secret (``env_from_secret``) through ``envFrom``, so no credential is ever written into a pod spec; a
job's own ``secret_env`` goes the same way, through a Secret of each run (:func:`secret_name`, created
before its pods, deleted after them).
Nothing of the orchestrator's own environment reaches a pod.

Every pod is sandboxed by its ``securityContext`` (:func:`sandboxed`): it runs as a non-root uid and
gid (``run_as_user``; ``fsGroup`` the same, so the checkpoint claim is writable), with no privilege
escalation, every capability dropped, the runtime's default seccomp profile and a read-only root
filesystem; its writable places are two emptyDirs, its working directory and ``HOME``
(:data:`WORK_DIR`) and ``/tmp``, and the checkpoint claim. It gets no service account token
(``automountServiceAccountToken: false``) unless ``service_account`` names one: an operator who
gives jobs a service account does so for them to use it (a cloud identity for a checkpoint bucket
through workload identity), so that one is mounted.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from opml_job_orchestrator.executor.base import (
    ExecutorEvent,
    JobOutcome,
    JobProgram,
    TaskState,
    attempts_logged,
    check_offset,
    check_seconds,
    read_log,
)
from opml_job_orchestrator.executor.tony import (
    CLUSTER_ROLES,
    RunTracker,
    TaskKey,
    Verdict,
    awaited_tasks,
    task_argv,
    task_env,
)
from opml_job_orchestrator.executor.tracked import TrackedRun, TrackedRunExecutor
from opml_job_orchestrator.scheduler.model import JobSpec, Resources

logger = logging.getLogger(__name__)

MANAGED_BY = ("app.kubernetes.io/managed-by", "opml-job-orchestrator")
CONTAINER = "tensorflow"
WORK_DIR = "/opml-job"
"""The task's working directory and ``HOME`` in its pod (an emptyDir: the root filesystem is read-only)."""
TASKS_ANNOTATION = "opml.io/tasks"
"""Every task of the run (``chief-0,worker-0,worker-1``), so a restarted executor can re-adopt it."""
JOB_ID_ANNOTATION = "opml.io/job-id"
"""The job id as given: the ``opml.io/job`` label holds a shortened form when the id is too long for a label."""

FATAL_WAITING_REASONS = frozenset({"InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError"})
"""Container waiting reasons that no amount of waiting fixes: the task cannot start."""
LOST_REASONS = frozenset({"Evicted", "NodeLost", "NodeShutdown", "Shutdown", "Terminated"})
"""Pod status reasons that mean the node, not the program, ended the task."""

_LABEL_SAFE = re.compile(r"[^a-z0-9-]+")


def label_value(job_id: str) -> str:
    """``job_id`` as a label value: itself when it fits (63 characters, alphanumeric at both ends)."""
    if len(job_id) <= 63 and job_id[-1].isalnum():
        return job_id
    return f"{job_id[:54].rstrip('._-')}-{_digest(job_id)}"


def run_name(job_id: str, attempt: int) -> str:
    """The base of the run's object names: a DNS label prefix short enough for ``-<role>`` after it."""
    slug = _LABEL_SAFE.sub("-", job_id)[:30].strip("-") or "job"
    return f"opml-{slug}-{_digest(job_id)}-a{attempt}"


def pod_name(job_id: str, attempt: int, role: str, index: int) -> str:
    return f"{run_name(job_id, attempt)}-{role}-{index}"


def run_selector(job_id: str, attempt: int) -> str:
    """The label selector of one run's objects."""
    return f"opml.io/job={label_value(job_id)},opml.io/attempt={attempt}"


def secret_name(job_id: str, attempt: int) -> str:
    """The Secret that holds a run's ``secret_env`` (its pods read it with ``envFrom``)."""
    return f"{run_name(job_id, attempt)}-env"


def render_run(spec: JobSpec, program: JobProgram, placement: Mapping[str, Sequence[str]], *, attempt: int,
               image: str, namespace: str, port: int = 2222, node_label: str | None = "kubernetes.io/hostname",
               checkpoint_claim: str | None = None, python: str = "python", service_account: str | None = None,
               env_from_secret: str | None = None, platform_env: Mapping[str, str] | None = None,
               run_as_user: int = 1000, pipeline_claim: tuple[str, str] | None = None) -> list[dict[str, Any]]:
    """The run's objects as API dicts, Services first: one headless Service per role, one Pod per replica.

    ``placement`` pins each pod to its node through ``nodeSelector`` on ``node_label`` (None leaves
    placement to the Kubernetes scheduler). Resources become requests (CPU, memory, GPUs as
    ``nvidia.com/gpu``) and limits (memory and GPUs; no CPU limit, which would throttle
    TensorFlow's thread pools). With ``checkpoint_claim``, that PersistentVolumeClaim is mounted at
    ``program.checkpoint_dir``, so a resumed run on another node finds its checkpoint.
    ``pipeline_claim``, (claim, path), is mounted at ``path`` in every pod: the pipelines' steps' folders,
    which the job-orchestrator writes at the same path on the same claim (a step's job reads its
    inputs and writes its outputs there).
    ``python`` is the image's interpreter, which runs the trace launcher of traced programs.
    ``service_account`` names the pods' service account; every pod gets ``platform_env`` (under
    the program's own ``env``) and, with ``env_from_secret``, that Secret's keys as variables (the
    jobs' scoped credentials, never the platform's). Every pod is sandboxed as :func:`sandboxed` says,
    as ``run_as_user``.
    """
    base = run_name(spec.job_id, attempt)
    tasks = ",".join(f"{r.role}-{r.index}" for r in spec.replicas)
    cluster = {role: [f"{role}-{i}.{base}-{role}.{namespace}.svc:{port}" for i in range(spec.roles[role].replicas)]
               for role in CLUSTER_ROLES if role in spec.roles}

    def labels(role: str, index: int | None = None) -> dict[str, str]:
        found = {MANAGED_BY[0]: MANAGED_BY[1], "opml.io/job": label_value(spec.job_id),
                 "opml.io/attempt": str(attempt), "opml.io/role": role}
        if index is not None:
            found["opml.io/index"] = str(index)
        return found

    objects: list[dict[str, Any]] = [{
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": f"{base}-{role}", "namespace": namespace, "labels": labels(role),
                     "annotations": {JOB_ID_ANNOTATION: spec.job_id}},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": labels(role),
                 "ports": [{"name": "tf", "port": port, "targetPort": port}]},
    } for role in spec.roles]
    if program.secret_env:  # created first: a pod that names a Secret not there yet does not start
        objects.insert(0, {
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": secret_name(spec.job_id, attempt), "namespace": namespace,
                         "labels": {MANAGED_BY[0]: MANAGED_BY[1], "opml.io/job": label_value(spec.job_id),
                                    "opml.io/attempt": str(attempt)},
                         "annotations": {JOB_ID_ANNOTATION: spec.job_id}},
            "stringData": dict(program.secret_env)})
    for replica in spec.replicas:
        role, index = replica.role, replica.index
        env = {**(platform_env or {}),
               **task_env(program, job_id=spec.job_id, attempt=attempt, role=role, index=index, cluster=cluster),
               "HOME": WORK_DIR, "TMPDIR": "/tmp"}
        container: dict[str, Any] = {
            "name": CONTAINER, "image": image,
            "command": task_argv(program, job_id=spec.job_id, role=role, index=index, python=python),
            "env": [{"name": k, "value": v} for k, v in env.items()],
            "resources": _resources(replica.resources),
            "workingDir": WORK_DIR,
            "volumeMounts": [{"name": "work", "mountPath": WORK_DIR}, {"name": "tmp", "mountPath": "/tmp"}],
        }
        if env_from_secret is not None:
            container["envFrom"] = [{"secretRef": {"name": env_from_secret}}]
        if program.secret_env:
            container.setdefault("envFrom", []).append({"secretRef": {"name": secret_name(spec.job_id, attempt)}})
        if role in CLUSTER_ROLES:
            container["ports"] = [{"name": "tf", "containerPort": port}]
        pod_spec: dict[str, Any] = {"restartPolicy": "Never", "hostname": f"{role}-{index}",
                                    "subdomain": f"{base}-{role}", "enableServiceLinks": False,
                                    "containers": [container],
                                    "volumes": [{"name": "work", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]}
        sandboxed(pod_spec, container, run_as_user=run_as_user, service_account=service_account)
        if node_label is not None:
            pod_spec["nodeSelector"] = {node_label: placement[role][index]}
        if checkpoint_claim is not None and program.checkpoint_dir is not None:
            pod_spec["volumes"].append({"name": "checkpoints",
                                        "persistentVolumeClaim": {"claimName": checkpoint_claim}})
            container["volumeMounts"].append({"name": "checkpoints", "mountPath": program.checkpoint_dir})
        if pipeline_claim is not None:
            pod_spec["volumes"].append({"name": "pipelines", "persistentVolumeClaim": {"claimName": pipeline_claim[0]}})
            container["volumeMounts"].append({"name": "pipelines", "mountPath": pipeline_claim[1]})
        objects.append({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod_name(spec.job_id, attempt, role, index), "namespace": namespace,
                         "labels": labels(role, index),
                         "annotations": {JOB_ID_ANNOTATION: spec.job_id, TASKS_ANNOTATION: tasks}},
            "spec": pod_spec,
        })
    return objects


def sandboxed(pod_spec: dict[str, Any], container: dict[str, Any], *, run_as_user: int,
              service_account: str | None) -> None:
    """Set what sandboxes a job's pod (see the module's docstring) on ``pod_spec`` and its ``container``."""
    pod_spec["securityContext"] = {"runAsNonRoot": True, "runAsUser": run_as_user, "runAsGroup": run_as_user,
                                   "fsGroup": run_as_user, "seccompProfile": {"type": "RuntimeDefault"}}
    container["securityContext"] = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    pod_spec["automountServiceAccountToken"] = service_account is not None
    if service_account is not None:
        pod_spec["serviceAccountName"] = service_account


def _resources(resources: Resources) -> dict[str, dict[str, str]]:
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if resources.cpu_millis:
        requests["cpu"] = f"{resources.cpu_millis}m"
    if resources.memory_mib:
        requests["memory"] = limits["memory"] = f"{resources.memory_mib}Mi"
    if resources.gpu:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(resources.gpu)
    return {"requests": requests, "limits": limits} if limits else {"requests": requests}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:6]


@dataclass(eq=False)
class _Run(TrackedRun):
    pods: dict[TaskKey, str]
    services: list[str]
    created: bool = False
    """Every pod of the run was created (or found, re-adopted): a listing taken since then that
    lacks one means it is gone. Before, it may not exist yet."""


class KubernetesExecutor(TrackedRunExecutor[_Run]):
    """Runs each replica of each role as a pod; see :class:`Executor` for the contract.

    Keyword-only settings, checked here: ``image`` (the container image of every task: it holds
    the job's code, TensorFlow, and for traced jobs the trace collector), ``log_dir`` (where the
    logs of ended runs are kept, ``{log_dir}/{job_id}/attempt-{n}/{role}-{index}.log``),
    ``namespace``, ``api`` (a ``kubernetes.client.CoreV1Api``; None: built at :meth:`start` from
    ``kubeconfig`` and its ``context`` when given, else from the in-cluster service account; the
    ``kubernetes`` package is imported only then), ``port`` (TensorFlow's gRPC port in every
    pod), ``node_label``, ``checkpoint_claim``, ``python``, ``service_account``, ``env_from_secret``,
    ``platform_env``, ``run_as_user`` and ``pipeline_claim`` (see :func:`render_run`),
    ``poll_interval_s`` (how often :meth:`poll` lists pods), ``cleanup_grace_s`` and
    ``shutdown_grace_s`` (as the local executor's), and ``delete_timeout_s`` (how long past the
    grace a deletion may take before the pods are deleted with no grace).

    Every API call runs in a worker thread (the client is synchronous). An API error while
    polling is logged and the next poll tries again; one while creating a run's objects fails
    the run (retriable when the API server was at fault: 5xx, 429, no answer).
    """

    adoptable = True  # pods outlive the orchestrator that made them: its successor re-adopts them

    def __init__(self, *, image: str, log_dir: str | Path, namespace: str = "default", api: Any = None,
                 kubeconfig: str | Path | None = None, context: str | None = None, port: int = 2222,
                 node_label: str | None = "kubernetes.io/hostname", checkpoint_claim: str | None = None,
                 python: str = "python", service_account: str | None = None, env_from_secret: str | None = None,
                 platform_env: Mapping[str, str] | None = None, run_as_user: int = 1000, poll_interval_s: float = 2.0,
                 cleanup_grace_s: float = 10.0, shutdown_grace_s: float = 10.0, delete_timeout_s: float = 60.0,
                 pipeline_claim: tuple[str, str] | None = None) -> None:
        for name, value in (("image", image), ("namespace", namespace)):
            if not isinstance(value, str) or not value:
                raise InvalidArgument(name, f"`{name}` must be a non-empty string, but got {value!r}.")
        if not isinstance(log_dir, str | Path) or not str(log_dir):
            raise InvalidArgument("log_dir", f"`log_dir` must be a directory path, but got {log_dir!r}.")
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise InvalidArgument("port", f"`port` must be an integer from 1 to 65535, but got {port!r}.")
        self._log_dir = Path(log_dir)
        self._namespace = namespace
        self._api = api
        self._kubeconfig = kubeconfig
        self._context = context
        self._render = functools.partial(render_run, image=image, namespace=namespace, port=port,
                                         node_label=node_label, checkpoint_claim=checkpoint_claim, python=python,
                                         service_account=service_account, env_from_secret=env_from_secret,
                                         platform_env=dict(platform_env or {}), run_as_user=run_as_user,
                                         pipeline_claim=pipeline_claim)
        self._node_label = node_label
        self._poll_interval_s = check_seconds(poll_interval_s, "poll_interval_s", positive=True)
        super().__init__(cleanup_grace_s=cleanup_grace_s, shutdown_grace_s=shutdown_grace_s)
        self._delete_timeout_s = check_seconds(delete_timeout_s, "delete_timeout_s", positive=True)

    async def _open(self) -> None:
        """Build the API client if none was given, create ``log_dir``."""
        if self._api is None:
            self._api = await asyncio.to_thread(_connect, self._kubeconfig, self._context)
        self._log_dir.mkdir(parents=True, exist_ok=True)

    async def _launch(self, spec: JobSpec, program: JobProgram, placement: dict[str, tuple[str, ...]], *,
                      attempt: int) -> None:
        objects = self._render(spec, program, placement, attempt=attempt)
        pods = {(r.role, r.index): pod_name(spec.job_id, attempt, r.role, r.index) for r in spec.replicas}
        services = [o["metadata"]["name"] for o in objects if o["kind"] == "Service"]
        run = _Run(RunTracker(spec.job_id, attempt, pods, awaited_tasks(pods)), placement, pods, services)
        self._runs[spec.job_id] = run
        creators = {"Secret": self._api.create_namespaced_secret, "Service": self._api.create_namespaced_service,
                    "Pod": self._api.create_namespaced_pod}
        for obj in objects:
            try:
                await self._call(creators[obj["kind"]], self._namespace, obj)
            except Exception as exc:  # noqa: BLE001 - any failure to create fails the run, retriable or not
                labels = obj["metadata"]["labels"]
                first = spec.replicas[0]
                key = ((labels["opml.io/role"], int(labels.get("opml.io/index", 0))) if "opml.io/role" in labels
                       else (first.role, first.index))  # the Secret: the run's first task could not start
                what = f"{obj['kind'].lower()} {obj['metadata']['name']}"
                event, verdict = run.tracker.could_not_start(
                    key, f"{key[0]} {key[1]} could not start: creating {what} failed: {_api_error(exc)}",
                    retriable=_retriable(exc))
                self._events.put_nowait(event)
                self._end_soon(run, verdict)
                return
        run.created = True

    async def _recover(self, job_id: str, attempt: int) -> Mapping[str, tuple[str, ...]] | None:
        """Re-adopt run ``attempt`` of ``job_id``: its pods outlive the executor, so they are only
        tracked again, and :meth:`poll` reports them from then on (RUNNING, then how they end).
        Returns where they run: each pod's node (``spec.nodeName``, or the node it is pinned to
        while it waits to be scheduled). A run of which a pod is gone, or not bound to a node it
        can name, is ended instead (its pods deleted at once, STOPPED, retriable): None."""
        found = await self._call(self._api.list_namespaced_pod, self._namespace,
                                 label_selector=run_selector(job_id, attempt))
        keys: list[TaskKey] = []
        for pod in found.items:
            for task in ((pod.metadata.annotations or {}).get(TASKS_ANNOTATION) or "").split(","):
                role, _, index = task.rpartition("-")
                if role and index.isdigit() and (role, int(index)) not in keys:
                    keys.append((role, int(index)))
        pods = {key: pod_name(job_id, attempt, *key) for key in sorted(keys)}
        services = [f"{run_name(job_id, attempt)}-{role}" for role in dict.fromkeys(r for r, _ in pods)]
        nodes = {pod.metadata.name: self._node_of(pod) for pod in found.items}
        placement: dict[str, tuple[str, ...]] = {}
        for role, index in pods:
            placement[role] = (*placement.get(role, ()), nodes.get(pods[role, index]) or "")
        run = _Run(RunTracker(job_id, attempt, pods, awaited_tasks(pods)), placement, pods, services, created=True)
        self._runs[job_id] = run
        unplaced = sorted(f"{role} {i}" for role, names in placement.items() for i, node in enumerate(names)
                          if not node)
        if not pods or unplaced:
            why = (f"pods of {', '.join(unplaced)} are gone or on no known node" if pods
                   else "no pod of the run was left")
            await self._end(run, Verdict(JobOutcome.STOPPED, f"recovered after a restart: {why}", True), grace_s=0)
            return None
        return placement

    async def poll(self, timeout_s: float) -> list[ExecutorEvent]:
        """List the pods every ``poll_interval_s`` until something happens or ``timeout_s`` passes."""
        timeout_s = check_seconds(timeout_s, "timeout_s", positive=False)
        deadline = time.monotonic() + timeout_s
        events: list[ExecutorEvent] = []
        while True:
            if any(run.tracker.outcome is None for run in self._runs.values()):
                await self._refresh()
            while not self._events.empty():
                events.append(self._events.get_nowait())
            remaining = deadline - time.monotonic()
            if events or remaining <= 0:
                return events
            with contextlib.suppress(TimeoutError):
                events.append(await asyncio.wait_for(self._events.get(), min(self._poll_interval_s, remaining)))

    async def logs(self, job_id: str, role: str, index: int, *, attempt: int | None = None, offset: int = 0) -> str:
        """The live pod's log while its run goes; the copy in ``log_dir`` once it ended.

        The copy is read from ``offset`` on; the API has no byte offset for a live pod's log
        (only lines, seconds or a byte limit from the start), so that one is read whole and cut.
        """
        offset = check_offset(offset)
        run = self._runs.get(job_id)
        job_dir = self._log_dir / job_id
        kept = attempts_logged(job_dir)
        if attempt is None:
            candidates = kept + ([run.attempt] if run is not None and run.pods else [])
            if not candidates:
                raise NotFound(f"job {job_id!r} was never launched on this executor.")
            attempt = max(candidates)
        copy = job_dir / f"attempt-{attempt}" / f"{role}-{index}.log"
        if copy.exists():
            return await asyncio.to_thread(read_log, copy, offset)
        try:
            data = await self._read_pod_log(pod_name(job_id, attempt, role, index))
            return data[offset:].decode("utf-8", "surrogateescape")
        except Exception as exc:  # noqa: BLE001 - mapped to the platform's errors below
            status = getattr(exc, "status", None)
            if status == 404:
                raise NotFound(f"job {job_id!r} attempt {attempt} has no task {role!r} {index!r}.") from None
            if status == 400:  # the container has not started yet
                return ""
            raise Unavailable(f"could not read the log of {role} {index} of job {job_id!r}: {_api_error(exc)}") from exc

    # -- internals -----------------------------------------------------------------------------

    async def _refresh(self) -> None:
        """List the executor's pods once and report what changed for every run still going whose
        pods were all created before the listing began (a launch may be creating them meanwhile)."""
        runs = [run for run in self._runs.values() if run.created]
        try:
            listed = await self._call(self._api.list_namespaced_pod, self._namespace,
                                      label_selector=f"{MANAGED_BY[0]}={MANAGED_BY[1]}")
        except Exception as exc:  # noqa: BLE001 - the API may be briefly away: the next poll retries
            logger.warning("listing pods failed, will retry: %s", _api_error(exc))
            return
        by_name = {pod.metadata.name: pod for pod in listed.items}
        for run in runs:
            if run.tracker.outcome is not None:
                continue
            for key, name in run.pods.items():
                verdict = self._observe(run, key, by_name.get(name))
                if verdict is not None:
                    self._end_soon(run, verdict)
                    break

    def _node_of(self, pod: Any) -> str | None:
        """The node ``pod`` runs on, or is pinned to by ``node_label`` while it waits; None if neither."""
        spec = pod.spec
        if spec is None:
            return None
        if spec.node_name or self._node_label is None:
            return spec.node_name
        return (spec.node_selector or {}).get(self._node_label)

    def _observe(self, run: _Run, key: TaskKey, pod: Any) -> Verdict | None:
        """Report what ``pod`` (None: it is gone) says of task ``key``; return the verdict if it ends the run."""
        state = run.tracker.states[key]
        if state not in (None, TaskState.RUNNING):
            return None
        role, index = key
        name = run.pods[key]
        if pod is None:
            event, verdict = run.tracker.lost(key, f"{role} {index}: pod {name} vanished")
            self._events.put_nowait(event)
            return verdict
        status = pod.status
        phase = getattr(status, "phase", None)
        container = next((c for c in (getattr(status, "container_statuses", None) or []) if c.name == CONTAINER),
                         None)
        reason = getattr(status, "reason", None)
        if reason in LOST_REASONS or phase == "Unknown":
            why = reason or "is in phase Unknown"
            message = f"{role} {index}: pod {name} {why}: {getattr(status, 'message', '')}"
            event, verdict = run.tracker.lost(key, message)
            self._events.put_nowait(event)
            return verdict
        if phase in (None, "Pending"):
            waiting = container.state.waiting if container is not None and container.state is not None else None
            if waiting is not None and waiting.reason in FATAL_WAITING_REASONS:
                event, verdict = run.tracker.could_not_start(
                    key, f"{role} {index} could not start: {waiting.reason}: {waiting.message}")
                self._events.put_nowait(event)
                return verdict
            return None
        if state is None:
            self._events.put_nowait(run.tracker.started(key, f"pod {name} on node {pod.spec.node_name}"))
        if phase == "Running":
            return None
        terminated = container.state.terminated if container is not None and container.state is not None else None
        if terminated is not None:
            code = terminated.exit_code
            how = f"exited with code {code}"
            if terminated.reason not in (None, "Completed", "Error"):
                how += f" ({terminated.reason})"
        else:
            code = 0 if phase == "Succeeded" else None
            how = "exited with code 0" if code == 0 else f"failed: {reason}: {getattr(status, 'message', '')}"
        event, verdict = run.tracker.exited(key, code, how=how)
        if event is not None:
            self._events.put_nowait(event)
        return verdict

    async def _stop_tasks(self, run: _Run, grace_s: float) -> None:
        """Keep the pods' logs, delete the pods with ``grace_s``, wait until they are gone (no grace
        at all after ``delete_timeout_s`` more), delete the Services and the run's Secret."""
        selector = run_selector(run.job_id, run.attempt)
        with contextlib.suppress(Exception):  # a last look, so tasks that ended are not reported stopped
            listed = await self._call(self._api.list_namespaced_pod, self._namespace, label_selector=selector)
            by_name = {pod.metadata.name: pod for pod in listed.items}
            for key, name in run.pods.items():
                if name in by_name:
                    self._observe(run, key, by_name[name])
        await self._keep_logs(run)
        await self._delete_pods(run, grace_s)
        deadline = time.monotonic() + grace_s + self._delete_timeout_s
        while True:
            try:
                left = (await self._call(self._api.list_namespaced_pod, self._namespace,
                                         label_selector=selector)).items
            except Exception as exc:  # noqa: BLE001
                logger.warning("listing the pods of %s failed, will retry: %s", selector, _api_error(exc))
                left = [None]
            if not left:
                break
            if time.monotonic() >= deadline:
                await self._delete_pods(run, 0)
                break
            await asyncio.sleep(min(self._poll_interval_s, 0.5))
        for service in run.services:
            await self._ignore_missing(self._api.delete_namespaced_service, service, self._namespace)
        # a run with no secret_env has none: a 404, ignored (a re-adopted run cannot tell)
        await self._ignore_missing(self._api.delete_namespaced_secret, secret_name(run.job_id, run.attempt),
                                   self._namespace)
        for key in run.tracker.running():
            self._events.put_nowait(run.tracker.stopped(key, "stopped: its pod was deleted"))

    async def _keep_logs(self, run: _Run) -> None:
        """Copy each pod's log to ``log_dir`` before the pod (and its log) is deleted."""
        run_dir = self._log_dir / run.job_id / f"attempt-{run.attempt}"
        for (role, index), name in run.pods.items():
            try:
                data = await self._read_pod_log(name)
            except Exception:  # noqa: BLE001 - no pod, or a container that never started: no log
                continue
            run_dir.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread((run_dir / f"{role}-{index}.log").write_bytes, data)

    async def _read_pod_log(self, name: str) -> bytes:
        """A pod's log as the container wrote it (raw bytes: the client would decode it as text)."""
        response = await self._call(self._api.read_namespaced_pod_log, name, self._namespace, container=CONTAINER,
                                    _preload_content=False)
        return response.data

    async def _delete_pods(self, run: _Run, grace_s: float) -> None:
        for name in run.pods.values():
            await self._ignore_missing(self._api.delete_namespaced_pod, name, self._namespace,
                                       grace_period_seconds=math.ceil(grace_s))

    async def _ignore_missing(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            await self._call(call, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - gone already is fine; anything else is logged
            if getattr(exc, "status", None) != 404:
                logger.warning("%s%s failed: %s", call.__name__, args, _api_error(exc))

    async def _call(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(functools.partial(call, *args, **kwargs))


def _connect(kubeconfig: str | Path | None, context: str | None) -> Any:
    """A CoreV1Api from ``kubeconfig`` (and ``context``), or from the in-cluster service account.

    Neither touches the client's global default configuration, and neither calls the API server.

    Raises:
        FailedPrecondition: the configuration cannot be loaded (no such file, not in a cluster).
    """
    from kubernetes import client, config

    source = f"the kubeconfig {str(kubeconfig)!r}" if kubeconfig is not None else "the in-cluster service account"
    try:
        if kubeconfig is not None:
            return client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig), context=context))
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.CoreV1Api(client.ApiClient(configuration))
    except (config.ConfigException, OSError) as exc:
        raise FailedPrecondition(f"cannot configure the Kubernetes client from {source}: {exc}") from exc


def _retriable(exc: Exception) -> bool:
    """An API failure the server caused (5xx, 429) or no answer at all: trying again may work."""
    status = getattr(exc, "status", None)
    return status is None or status == 429 or status >= 500


def _api_error(exc: Exception) -> str:
    """An ApiException's status, reason and the server's message; any other error as itself."""
    status = getattr(exc, "status", None)
    if status is None:
        return f"{type(exc).__name__}: {exc}"
    message = ""
    with contextlib.suppress(Exception):
        message = json.loads(exc.body).get("message", "")  # type: ignore[attr-defined]
    return f"{status} {getattr(exc, 'reason', '')}{': ' + message if message else ''}"
