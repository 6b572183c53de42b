"""Trial templates -> job-orchestrator job specs.

Katib runs a trial by creating the Kubernetes object of ``trialSpec`` with the trial's parameters
substituted. Here a trial is a TE job of the job-orchestrator, so each supported kind is mapped to
the orchestrator's job spec:

- ``batch/v1 Job``: the primary container (``primaryContainerName``) becomes a one-worker job;
  its ``command`` + ``args`` the argv, its ``env`` values the env, its cpu/memory/GPU requests (else
  limits) the resources. Its ``image`` runs where the orchestrator's Kubernetes executor is
  configured (that executor has one image for every task), and is ignored by the local executor:
  :attr:`TrialJob.notes` says so.
- ``kubeflow.org/v1 TFJob``: each replica type (Chief or Master, Worker, PS, Evaluator) becomes the
  orchestrator's role of that name (TonY's chief/worker/ps/evaluator), replicas kept.
- ``jobs.opml.dev/v1 OpmlJob``: the platform's own job spec (``spec`` as ``opml job submit`` reads
  it, without ``name``).
- ``jobs.opml.dev/v1 ServingConfigSurrogate``: no job; the trial is a prediction of the
  inference-router (:mod:`.surrogate` checks and maps it).

Any other kind (PyTorchJob, MPIJob, XGBoostJob, Argo Workflow, Tekton PipelineRun, TrainJob...) is
rejected by kind with this list.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opml.jobs.v1 import jobs_pb2

from opml_automl_controller.experiment import TrialParameter, TrialTemplate
from opml_automl_controller.trialmodel import MODEL_DIR_VARIABLE
from opml_automl_controller.uploadenv import RESERVED_PREFIX
from opml_common.errors import InvalidArgument
from opml_job_orchestrator_contract.jobspec import check_env, load_spec, parse_cpu_millis, parse_memory_mib

SURROGATE_KIND = "jobs.opml.dev/v1 ServingConfigSurrogate"
"""Not a job: a trial evaluated by the inference-router's performance model (:mod:`.surrogate`)."""
SUPPORTED_KINDS = ("batch/v1 Job", "kubeflow.org/v1 TFJob", "jobs.opml.dev/v1 OpmlJob", SURROGATE_KIND)
TF_ROLES = {"Chief": "chief", "Master": "chief", "Worker": "worker", "PS": "ps", "Evaluator": "evaluator"}
MAX_REPLICAS = 2**31 - 1
DEFAULT_CPU_MILLIS = 500
DEFAULT_MEMORY_MIB = 512
_PLACEHOLDER = re.compile(r"\$\{trialParameters\.([^}]*)\}")

Violations = list[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class TrialJob:
    """A trial's job spec (its ``name`` unset: the controller names it), and what of the template
    the orchestrator does not use (the image on the local executor, sidecars, extended resources)."""

    spec: jobs_pb2.JobSpec
    notes: tuple[str, ...]


def _kind_of(body: Mapping[str, Any]) -> str:
    return f"{body.get('apiVersion')} {body.get('kind')}"


def check_template(body: Mapping[str, Any], declared: Sequence[TrialParameter], path: str,
                   primary: str) -> Violations:
    """Rules 26-31 of Katib's webhook on a template, then its mapping to a job (with placeholder
    values, so a template that only breaks once substituted is caught at admission)."""
    found: Violations = []
    kind = _kind_of(body)
    if body.get("apiVersion") and body.get("kind") and kind not in SUPPORTED_KINDS:
        found.append((f"{path}.kind", f"trial kind {kind} is not supported; supported kinds: "
                                      f"{', '.join(SUPPORTED_KINDS)}"))
    text = repr(body)
    for parameter in declared:
        if f"${{trialParameters.{parameter.name}}}" not in text:
            found.append((path, f"parameter {parameter.name} in spec.trialTemplate.trialParameters not found in "
                                f"trialSpec (${{trialParameters.{parameter.name}}})"))
            return found  # Katib returns at the first one
    names = {p.name for p in declared}
    for undeclared in sorted(set(_PLACEHOLDER.findall(text)) - names):
        found.append((path, f"undeclared placeholder ${{trialParameters.{undeclared}}}: declare it in "
                            f"spec.trialTemplate.trialParameters"))
    metadata = body.get("metadata") if isinstance(body.get("metadata"), Mapping) else {}
    for key in ("name", "namespace"):
        if key in metadata:
            found.append((f"{path}.metadata.{key}", "must not be set in the trial template (the trial names it)"))
    for key in ("apiVersion", "kind"):
        if not body.get(key):
            found.append((f"{path}.{key}", "is required"))
    if found or kind == SURROGATE_KIND:
        return found
    template = TrialTemplate(api_version=str(body["apiVersion"]), kind=str(body["kind"]), spec=dict(body),
                             primary_container=primary, parameters=tuple(declared))
    try:
        build_trial_job(template, {p.name: "1" for p in declared}, trial_name="trial", namespace="default",
                        path=path)
    except InvalidArgument as error:
        found.extend(error.violations)
    return found


def substitute(template: TrialTemplate, values: Mapping[str, str], *, trial_name: str,
               namespace: str) -> dict[str, Any]:
    """The template with every ``${trialParameters.X}`` replaced: by the trial's value of the
    parameter X references, or by trial metadata for ``${trialSpec.*}`` references."""
    metadata = template.spec.get("metadata") or {}
    replacements: dict[str, str] = {}
    for parameter in template.parameters:
        reference = parameter.reference
        if reference in values:
            replacements[parameter.name] = str(values[reference])
            continue
        match = re.fullmatch(r"\$\{trialSpec\.(\w+)(?:\[([^\]]+)\])?\}", reference)
        if match is None:
            replacements[parameter.name] = str(values.get(parameter.name, ""))
            continue
        field, key = match.groups()
        replacements[parameter.name] = {
            "Name": trial_name, "Namespace": namespace, "Kind": template.kind, "APIVersion": template.api_version,
            "Labels": str((metadata.get("labels") or {}).get(key, "")),
            "Annotations": str((metadata.get("annotations") or {}).get(key, "")),
        }.get(field, "")

    def walk(node: Any) -> Any:
        if isinstance(node, str):
            return _PLACEHOLDER.sub(lambda m: replacements.get(m.group(1), m.group(0)), node)
        if isinstance(node, Mapping):
            return {walk(k): walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(copy.deepcopy(template.spec))


def build_trial_job(template: TrialTemplate, values: Mapping[str, str], *, trial_name: str, namespace: str,
                    path: str = "spec.trialTemplate.trialSpec") -> TrialJob:
    """The job spec of one trial (``values``: parameter name -> value as text).

    Raises:
        InvalidArgument: the kind is not supported, or the substituted template cannot be run (no
            primary container, no command...): every problem, with its path under ``path``.
    """
    body = substitute(template, values, trial_name=trial_name, namespace=namespace)
    kind = _kind_of(body)
    found: Violations = []
    notes: list[str] = []
    if kind == "batch/v1 Job":
        spec = jobs_pb2.JobSpec(job_class=jobs_pb2.JOB_CLASS_TE, max_retries=0)
        pod = _pod_spec(body.get("spec"), f"{path}.spec.template.spec", ("template",), found)
        if pod is not None:
            _role(spec, "worker", 1, pod, template.primary_container, f"{path}.spec.template.spec", found, notes)
    elif kind == "kubeflow.org/v1 TFJob":
        spec = jobs_pb2.JobSpec(job_class=jobs_pb2.JOB_CLASS_TE, max_retries=0)
        replicas = (body.get("spec") or {}).get("tfReplicaSpecs")
        if not isinstance(replicas, Mapping) or not replicas:
            found.append((f"{path}.spec.tfReplicaSpecs", "is required (Chief, Worker, PS, Evaluator)"))
        else:
            for replica_type, replica in replicas.items():
                where = f"{path}.spec.tfReplicaSpecs.{replica_type}"
                if replica_type not in TF_ROLES:
                    found.append((where, f"replica type {replica_type!r} is not one of {list(TF_ROLES)}"))
                    continue
                if TF_ROLES[replica_type] in spec.roles:
                    found.append((where, "Chief and Master are the same role; give one"))
                    continue
                replica = replica if isinstance(replica, Mapping) else {}
                count = replica.get("replicas", 1)
                if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_REPLICAS:
                    found.append((f"{where}.replicas", f"must be an integer from 1 to {MAX_REPLICAS} (TFJob's "
                                                       f"int32), but got {count!r}"))
                    continue
                pod = _pod_spec(replica, f"{where}.template.spec", ("template",), found)
                if pod is not None:
                    _role(spec, TF_ROLES[replica_type], count, pod, template.primary_container,
                          f"{where}.template.spec", found, notes)
    elif kind == "jobs.opml.dev/v1 OpmlJob":
        job = body.get("spec")
        if not isinstance(job, Mapping):
            found.append((f"{path}.spec", "must be the platform's job spec (a mapping, as `opml job submit` reads)"))
            spec = jobs_pb2.JobSpec()
        elif "name" in job:
            found.append((f"{path}.spec.name", "must not be set (the trial names its job)"))
            spec = jobs_pb2.JobSpec()
        else:
            try:
                spec = load_spec({"class": "TE", **job})
            except InvalidArgument as error:
                found.extend((f"{path}.spec.{field}", rule) for field, rule in error.violations)
                spec = jobs_pb2.JobSpec()
            if spec.job_class != jobs_pb2.JOB_CLASS_TE:
                found.append((f"{path}.spec.class", "must be TE: a trial is trial-and-error work"))
            if spec.checkpoint.dir:
                found.append((f"{path}.spec.checkpoint.dir", f"is set by the controller: each trial's own model "
                                                             f"folder (${MODEL_DIR_VARIABLE}), which the "
                                                             f"orchestrator makes for the trial's job; keep the "
                                                             f"trial's checkpoints in it"))
    else:
        raise InvalidArgument(f"{path}.kind", f"trial kind {kind} is not supported; supported kinds: "
                                              f"{', '.join(SUPPORTED_KINDS)}")
    try:
        check_env(spec.env, f"{path}.env")
    except InvalidArgument as error:
        found.extend(error.violations)
    found.extend((f"{path}.env.{name}", "is set by the controller (AUTOML_*: the trial's own folder, and where "
                                        "and with what grant it uploads its model)")
                 for name in sorted(spec.env) if name.upper().startswith(RESERVED_PREFIX))
    if spec.secret_env:
        found.append((f"{path}.spec.secret_env", "is the controller's to set (the trial's upload grant)"))
    if found:
        raise InvalidArgument.of(found)
    return TrialJob(spec=spec, notes=tuple(notes))


def _pod_spec(owner: Any, path: str, keys: tuple[str, ...], found: Violations) -> Mapping[str, Any] | None:
    node = owner if isinstance(owner, Mapping) else {}
    for key in keys:
        node = node.get(key) if isinstance(node, Mapping) else None
    pod = node.get("spec") if isinstance(node, Mapping) else None
    if not isinstance(pod, Mapping) or not isinstance(pod.get("containers"), list):
        found.append((f"{path}.containers", "is required (a pod template with containers)"))
        return None
    return pod


def _role(spec: jobs_pb2.JobSpec, role: str, replicas: int, pod: Mapping[str, Any], primary: str, path: str,
          found: Violations, notes: list[str]) -> None:
    """One role of ``spec`` from a pod template's primary container."""
    containers = [c for c in pod["containers"] if isinstance(c, Mapping)]
    index = next((i for i, c in enumerate(containers) if c.get("name") == primary), None)
    if index is None:
        found.append((f"{path}.containers", f"has no container named {primary!r} (primaryContainerName)"))
        return
    container, where = containers[index], f"{path}.containers[{index}]"
    command = container.get("command") or []
    args = container.get("args") or []
    if not isinstance(command, list) or not isinstance(args, list):
        found.append((f"{where}.command", "command and args must be lists of strings"))
        return
    if not command:
        found.append((f"{where}.command", "is required: the image's entrypoint is not known to the orchestrator's "
                                          "local executor, so the trial's argv must be given"))
        return
    argv = [str(part) for part in [*command, *args]]
    message = spec.roles[role]
    message.replicas = replicas
    message.command.extend(argv)
    if container.get("image"):
        notes.append(f"{where}.image ({container['image']}) is used by the orchestrator's Kubernetes executor "
                     f"only; the local executor runs the command on the host and ignores it")
    for other in containers[:index] + containers[index + 1:]:
        notes.append(f"{path}: container {other.get('name')!r} is not the primary container and is not run")
    for item in container.get("env") or []:
        if not isinstance(item, Mapping) or not item.get("name"):
            found.append((f"{where}.env", "each item needs a name"))
            continue
        if "value" in item:
            spec.env[str(item["name"])] = str(item["value"])
        else:
            notes.append(f"{where}.env.{item['name']}: valueFrom is not supported and the variable is not set")
    resources = container.get("resources") if isinstance(container.get("resources"), Mapping) else {}
    amounts: dict[Any, Any] = {}
    for part in ("limits", "requests"):  # requests win
        given = resources.get(part) or {}
        if isinstance(given, Mapping):
            amounts.update(given)
        else:
            found.append((f"{where}.resources.{part}", f"must be a mapping of resource amounts, but got {given!r}"))
    for key, value in amounts.items():
        try:
            if key == "cpu":
                message.resources.cpu_millis = parse_cpu_millis(value, f"{where}.resources.cpu")
            elif key == "memory":
                message.resources.memory_mib = parse_memory_mib(value, f"{where}.resources.memory")
            elif key == "nvidia.com/gpu":
                message.resources.gpu = int(value)
            else:
                notes.append(f"{where}.resources: {key} has no counterpart in the orchestrator and is ignored")
        except (InvalidArgument, ValueError, TypeError, OverflowError):  # ValueError: past the proto's int64 too
            found.append((f"{where}.resources.{key}", f"must be a Kubernetes quantity, but got {value!r}"))
    if not message.resources.cpu_millis and not message.resources.memory_mib and not message.resources.gpu:
        message.resources.cpu_millis = DEFAULT_CPU_MILLIS
        message.resources.memory_mib = DEFAULT_MEMORY_MIB
