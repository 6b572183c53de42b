"""Pipeline specs as users write them: a YAML document (or a dict) -> ``opml.jobs.v1.PipelineSpec``,
and the rules of a pipeline that the orchestrator applies to every apply.

A pipeline is a DAG of named steps, each of one kind (``ingest``, ``validate``, ``train``,
``evaluate``, ``bless``, ``push``) with its settings under the key of its kind and the steps it
reads in ``inputs``. Every error is an ``InvalidArgument`` naming the field path
(``steps[2].train.command``), the value and the rule; a spec with several mistakes gets them all in
one error, shapes first, then the pipeline's rules (a cycle, an input naming no step, a kind reading
what it cannot), as :mod:`~opml_job_orchestrator_contract.jobspec` does for jobs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from google.protobuf.struct_pb2 import Struct
from opml.jobs.v1 import jobs_pb2
from opml.jobs.v1 import pipelines_pb2 as pb

from opml_common.errors import InvalidArgument
from opml_common.yamlsafe import load_yaml
from opml_job_orchestrator_contract.jobspec import (
    _UNREAD,
    _argv,
    _boolean,
    _cpu_millis,
    _integer,
    _memory_mib,
    _short,
    _string,
    _Violations,
    check_env,
)
from opml_job_orchestrator_contract.schedule import parse_schedule

KINDS = {"ingest": pb.STEP_KIND_INGEST, "validate": pb.STEP_KIND_VALIDATE, "train": pb.STEP_KIND_TRAIN,
         "evaluate": pb.STEP_KIND_EVALUATE, "bless": pb.STEP_KIND_BLESS, "push": pb.STEP_KIND_PUSH}
KIND_NAMES = {value: key for key, value in KINDS.items()}
PIPELINE_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")
STEP_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,29}")
CONTEXT_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
MAX_STEPS = 32

_TOP_KEYS = {"name", "steps", "triggers", "context"}
_TRIGGER_KEYS = {"on_span", "on_alert", "schedule"}
_STEP_KEYS = {"name", "kind", "inputs", *KINDS}
_INGEST_KEYS = {"context", "bundle_name", "tags", "latest", "rolling", "range"}
_VALIDATE_KEYS = {"label", "thresholds"}
_TRAIN_KEYS = {"class", "command", "resources", "env", "warm_start", "trace", "code_version", "max_retries"}
_RESOURCE_KEYS = {"cpu", "memory", "gpu"}
_PUSH_KEYS = {"context", "bundle_name", "tags", "rollout", "model", "monitoring"}
_MONITORING_KEYS = {"segment"}
SEGMENT_PARAMETER = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""A request parameter the monitoring-scorer may segment by (its monitoring.yaml's segment.parameter)."""
_CLASSES = {"TE": jobs_pb2.JOB_CLASS_TE, "BE": jobs_pb2.JOB_CLASS_BE}

# What each kind reads: {input kind: (least, most)}; an input of a kind not listed is refused.
INPUT_RULES: dict[int, dict[int, tuple[int, int]]] = {
    pb.STEP_KIND_INGEST: {},
    pb.STEP_KIND_VALIDATE: {pb.STEP_KIND_INGEST: (1, 1)},
    pb.STEP_KIND_TRAIN: {pb.STEP_KIND_INGEST: (1, 1), pb.STEP_KIND_VALIDATE: (0, 1)},
    pb.STEP_KIND_EVALUATE: {pb.STEP_KIND_TRAIN: (1, 1), pb.STEP_KIND_INGEST: (1, 1), pb.STEP_KIND_VALIDATE: (0, 1)},
    pb.STEP_KIND_BLESS: {pb.STEP_KIND_EVALUATE: (1, 1)},
    pb.STEP_KIND_PUSH: {pb.STEP_KIND_BLESS: (1, 1)},
}
SINGLE_KINDS = (pb.STEP_KIND_BLESS, pb.STEP_KIND_PUSH)
"""At most one per pipeline: a pipeline has one blessed model and pushes it to one place."""


def load_pipeline(source: str | Mapping[str, Any], *, what: str = "spec") -> pb.PipelineSpec:
    """Parse a YAML pipeline spec (text, or the mapping it loads to) into a ``PipelineSpec``.

    Raises:
        InvalidArgument: the YAML does not parse or is too big (on ``what``), or any shape or rule
            is broken: one violation per field path, every one found.
    """
    if isinstance(source, str):
        source = load_yaml(source, what=what)
    if not isinstance(source, Mapping):
        raise InvalidArgument("spec", f"must be a mapping, but got {_short(source)}")
    found = _Violations()
    doc = found.mapping(source, "spec", _TOP_KEYS)
    spec = pb.PipelineSpec(name=found.check(_string, doc.get("name", ""), "name", default=""),
                           context=found.check(_string, doc.get("context", ""), "context", default=""))
    triggers = found.mapping(doc.get("triggers", {}), "triggers", _TRIGGER_KEYS)
    spec.triggers.on_span = found.check(_boolean, triggers.get("on_span", False), "triggers.on_span", default=False)
    spec.triggers.on_alert = found.check(_boolean, triggers.get("on_alert", False), "triggers.on_alert",
                                         default=False)
    spec.triggers.schedule = found.check(_string, triggers.get("schedule", ""), "triggers.schedule", default="")
    steps = doc.get("steps", [])
    if not isinstance(steps, list):
        found.add("steps", f"must be a list of steps, but got {_short(steps)}")
        steps = []
    for index, body in enumerate(steps):
        spec.steps.append(_step(found, body, f"steps[{index}]"))
    found.extend(pipeline_violations(spec))
    if found:
        found.raise_all()
    return spec


def _step(found: _Violations, body: Any, field: str) -> pb.PipelineStep:
    body = found.mapping(body, field, _STEP_KEYS)
    step = pb.PipelineStep(name=found.check(_string, body.get("name", ""), f"{field}.name", default=""))
    inputs = body.get("inputs", [])
    if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
        found.add(f"{field}.inputs", f"must be a list of step names, but got {_short(inputs)}")
    else:
        step.inputs.extend(inputs)
    kind = body.get("kind")
    if kind not in KINDS:
        found.add(f"{field}.kind", f"must be one of {list(KINDS)}, but got {_short(kind)}")
        return step
    step.kind = KINDS[kind]
    for other in KINDS:
        if other != kind and other in body:
            found.add(f"{field}.{other}", f"is the settings of {_a(other)} step, but this step is {_a(kind)} step")
    config = found.mapping(body.get(kind, {}), f"{field}.{kind}",
                           {"ingest": _INGEST_KEYS, "validate": _VALIDATE_KEYS, "train": _TRAIN_KEYS,
                            "evaluate": None, "bless": set(), "push": _PUSH_KEYS}[kind])
    where = f"{field}.{kind}"
    if kind == "ingest":
        _ingest(found, config, where, step.ingest)
    elif kind == "validate":
        label = config.get("label")
        step.validate.label = "" if label is None else found.check(_string, label, f"{where}.label", default="")
        _struct(found, config.get("thresholds", {}), f"{where}.thresholds", step.validate.thresholds)
    elif kind == "train":
        _train(found, config, where, step.train)
    elif kind == "evaluate":
        _struct(found, dict(config), where, step.evaluate.config)
    elif kind == "bless":
        step.bless.SetInParent()
    else:
        push = step.push
        push.context = found.check(_string, config.get("context", ""), f"{where}.context", default="")
        push.bundle_name = found.check(_string, config.get("bundle_name", ""), f"{where}.bundle_name", default="")
        push.model = found.check(_string, config.get("model", ""), f"{where}.model", default="")
        _string_map(found, config.get("tags", {}), f"{where}.tags", push.tags)
        _struct(found, config.get("rollout", {}), f"{where}.rollout", push.rollout)
        monitoring = found.mapping(config.get("monitoring", {}), f"{where}.monitoring", _MONITORING_KEYS)
        segment = found.check(_string, monitoring.get("segment", ""), f"{where}.monitoring.segment", default="")
        if segment and not SEGMENT_PARAMETER.fullmatch(segment):
            found.add(f"{where}.monitoring.segment", f"must name a request parameter ({SEGMENT_PARAMETER.pattern}), "
                                                     f"but got {_short(segment)}")
        else:
            push.monitoring.segment = segment
    return step


def _ingest(found: _Violations, config: Mapping[str, Any], where: str, ingest: pb.IngestConfig) -> None:
    ingest.context = found.check(_string, config.get("context", ""), f"{where}.context", default="")
    ingest.bundle_name = found.check(_string, config.get("bundle_name", ""), f"{where}.bundle_name", default="")
    _string_map(found, config.get("tags", {}), f"{where}.tags", ingest.tags)
    windows = [key for key in ("latest", "rolling", "range") if key in config]
    if len(windows) > 1:
        found.add(where, f"must set at most one of latest, rolling, range, but sets {windows}")
    if "rolling" in config:
        ingest.rolling = found.check(_integer, config["rolling"], f"{where}.rolling", default=1)
    elif "range" in config:
        bounds = found.mapping(config["range"], f"{where}.range", {"start", "end"})
        ingest.range.start = found.check(_integer, bounds.get("start", 0), f"{where}.range.start", default=0)
        ingest.range.end = found.check(_integer, bounds.get("end", 0), f"{where}.range.end", default=0)
    else:
        latest = found.check(_boolean, config.get("latest", True), f"{where}.latest", default=True)
        if not latest:
            found.add(f"{where}.latest", "may only be true (or set rolling or range instead)")
        ingest.latest = True


def _train(found: _Violations, config: Mapping[str, Any], where: str, train: pb.TrainConfig) -> None:
    job_class = config.get("class", "BE")
    if not isinstance(job_class, str) or job_class.upper() not in _CLASSES:
        found.add(f"{where}.class", f"must be TE or BE, but got {_short(job_class)}")
    else:
        train.job_class = _CLASSES[job_class.upper()]
    train.command.extend(found.check(_argv, config.get("command", []), f"{where}.command", default=[_UNREAD]))
    resources = found.mapping(config.get("resources", {}), f"{where}.resources", _RESOURCE_KEYS)
    train.resources.cpu_millis = found.check(_cpu_millis, resources.get("cpu", 1), f"{where}.resources.cpu",
                                             default=0)
    train.resources.memory_mib = found.check(_memory_mib, resources.get("memory", 512), f"{where}.resources.memory",
                                             default=0)
    train.resources.gpu = found.check(_integer, resources.get("gpu", 0), f"{where}.resources.gpu", default=0)
    _string_map(found, config.get("env", {}), f"{where}.env", train.env)
    train.warm_start = found.check(_boolean, config.get("warm_start", False), f"{where}.warm_start", default=False)
    train.trace = found.check(_boolean, config.get("trace", False), f"{where}.trace", default=False)
    train.code_version = found.check(_string, str(config.get("code_version", "")), f"{where}.code_version",
                                     default="")
    if "max_retries" in config:
        train.max_retries = found.check(_integer, config["max_retries"], f"{where}.max_retries", default=0)


def _string_map(found: _Violations, value: Any, field: str, target: Any) -> None:
    for key, item in found.mapping(value, field, None).items():
        if isinstance(item, bool):
            item = "true" if item else "false"
        elif isinstance(item, int | float):
            item = str(item)
        target[str(key)] = found.check(_string, item, f"{field}.{key}", default="")


def _struct(found: _Violations, value: Any, field: str, target: Struct) -> None:
    """A free-form section passed through to the step program: a mapping of JSON values."""
    if not isinstance(value, Mapping):
        found.add(field, f"must be a mapping, but got {_short(value)}")
        return
    try:
        target.update({str(k): v for k, v in value.items()})
    except (ValueError, TypeError) as exc:
        found.add(field, f"must hold only JSON values (strings, numbers, booleans, lists, mappings): {exc}")


def pipeline_violations(spec: pb.PipelineSpec) -> list[tuple[str, str]]:
    """Every rule of the pipeline itself that ``spec`` breaks, as (field path, rule), in message order."""
    violations: list[tuple[str, str]] = []
    if not PIPELINE_NAME.fullmatch(spec.name):
        violations.append(("name", f"must match {PIPELINE_NAME.pattern}, but got {spec.name!r}"))
    if spec.context and not CONTEXT_ID.fullmatch(spec.context):
        violations.append(("context", f"must be a context id ({CONTEXT_ID.pattern}), but got {spec.context!r}"))
    if not spec.steps:
        violations.append(("steps", "must hold at least one step"))
    if len(spec.steps) > MAX_STEPS:
        violations.append(("steps", f"must hold at most {MAX_STEPS} steps, but has {len(spec.steps)}"))
    index_of: dict[str, int] = {}
    for index, step in enumerate(spec.steps):
        field = f"steps[{index}]"
        if not STEP_NAME.fullmatch(step.name):
            violations.append((f"{field}.name", f"must match {STEP_NAME.pattern}, but got {step.name!r}"))
        elif step.name in index_of:
            violations.append((f"{field}.name", f"{step.name!r} is the name of steps[{index_of[step.name]}] "
                                                "already; step names are unique"))
        else:
            index_of[step.name] = index
    for index, step in enumerate(spec.steps):
        violations.extend(_step_violations(spec, index, step, index_of))
    for kind in SINGLE_KINDS:
        of_kind = [i for i, s in enumerate(spec.steps) if s.kind == kind]
        if len(of_kind) > 1:
            violations.append((f"steps[{of_kind[1]}].kind", f"a pipeline has at most one {KIND_NAMES[kind]} step, "
                                                            f"but steps {of_kind} are"))
    cycle = find_cycle(spec)
    if cycle:
        violations.append((f"steps[{index_of[cycle[0]]}].inputs",
                           "the steps form a cycle: " + " -> ".join([*cycle, cycle[0]])))
    kinds = {s.kind for s in spec.steps}
    if spec.triggers.on_span and pb.STEP_KIND_INGEST not in kinds:
        violations.append(("triggers.on_span", "needs an ingest step (whose spans start the pipeline)"))
    if spec.triggers.on_alert and not any(s.kind == pb.STEP_KIND_PUSH and s.push.model for s in spec.steps):
        violations.append(("triggers.on_alert", "needs a push step with `model` set (the model whose alerts "
                                                "start the pipeline)"))
    if spec.triggers.schedule:
        try:
            parse_schedule(spec.triggers.schedule, "triggers.schedule")
        except InvalidArgument as error:
            violations.extend(error.violations)
    return violations


def _step_violations(spec: pb.PipelineSpec, index: int, step: pb.PipelineStep,
                     index_of: Mapping[str, int]) -> list[tuple[str, str]]:
    field = f"steps[{index}]"
    violations: list[tuple[str, str]] = []
    if step.kind not in INPUT_RULES:
        violations.append((f"{field}.kind", f"must be one of {list(KINDS)}, but is unset"))
        return violations
    kind = KIND_NAMES[step.kind]
    read: dict[int, int] = {}
    for position, name in enumerate(step.inputs):
        if name == step.name:
            violations.append((f"{field}.inputs[{position}]", "a step cannot read itself"))
        elif name not in index_of:
            violations.append((f"{field}.inputs[{position}]", f"names no step of the pipeline: {name!r}"))
        else:
            input_kind = spec.steps[index_of[name]].kind
            if input_kind not in INPUT_RULES[step.kind]:
                allowed = [KIND_NAMES[k] for k in INPUT_RULES[step.kind]] or "nothing"
                violations.append((f"{field}.inputs[{position}]", f"{_a(kind)} step reads {allowed}, but "
                                   f"{name!r} is {_a(KIND_NAMES.get(input_kind, 'unknown'))} step"))
            read[input_kind] = read.get(input_kind, 0) + 1
    for input_kind, (least, most) in INPUT_RULES[step.kind].items():
        count = read.get(input_kind, 0)
        if not least <= count <= most:
            wanted = f"exactly {least}" if least == most else f"{least} to {most}"
            violations.append((f"{field}.inputs", f"{_a(kind)} step reads {wanted} {KIND_NAMES[input_kind]} "
                                                  f"step(s), but names {count}"))
    where = f"{field}.{kind}"
    if step.kind == pb.STEP_KIND_INGEST:
        ingest = step.ingest
        if not CONTEXT_ID.fullmatch(ingest.context):
            violations.append((f"{where}.context", f"must be a context id, but got {ingest.context!r}"))
        window = ingest.WhichOneof("window")
        if window == "rolling" and ingest.rolling < 1:
            violations.append((f"{where}.rolling", f"must be an integer >= 1, but got {ingest.rolling}"))
        if window == "range" and not 0 <= ingest.range.start <= ingest.range.end:
            violations.append((f"{where}.range", f"must have 0 <= start <= end, but got "
                                                 f"[{ingest.range.start}, {ingest.range.end}]"))
    elif step.kind == pb.STEP_KIND_TRAIN:
        train = step.train
        if train.job_class == jobs_pb2.JOB_CLASS_UNSPECIFIED:
            violations.append((f"{where}.class", "must be TE or BE"))
        if not train.command:
            violations.append((f"{where}.command", "must be the training program's argv, e.g. [python, train.py]"))
        if any("\0" in arg for arg in train.command):
            violations.append((f"{where}.command", "must not contain a NUL byte"))
        if train.resources.cpu_millis <= 0 or train.resources.memory_mib <= 0 or train.resources.gpu < 0:
            violations.append((f"{where}.resources", "cpu and memory must be > 0 and gpu >= 0"))
        try:
            check_env(train.env, f"{where}.env")
        except InvalidArgument as error:
            violations.extend(error.violations)
        if train.HasField("max_retries") and train.max_retries < 0:
            violations.append((f"{where}.max_retries", f"must be >= 0, but got {train.max_retries}"))
    elif step.kind == pb.STEP_KIND_EVALUATE:
        label = step.evaluate.config.fields.get("label")
        if label is None or label.WhichOneof("kind") != "string_value" or not label.string_value:
            violations.append((f"{where}.label", "is required: the label column of the spans"))
    elif step.kind == pb.STEP_KIND_PUSH:
        if not CONTEXT_ID.fullmatch(step.push.context):
            violations.append((f"{where}.context", f"must be a context id, but got {step.push.context!r}"))
        if step.push.bundle_name and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", step.push.bundle_name):
            violations.append((f"{where}.bundle_name", f"must be a bundle name, but got {step.push.bundle_name!r}"))
    return violations


def _a(kind: str) -> str:
    return f"an {kind}" if kind[:1] in "aeiou" else f"a {kind}"


def find_cycle(spec: pb.PipelineSpec) -> list[str]:
    """A cycle of step names (each reads the next... back to the first), or [] when the steps form a DAG."""
    inputs = {step.name: [name for name in step.inputs if name != step.name] for step in spec.steps}
    color: dict[str, int] = {}
    path: list[str] = []

    def visit(name: str) -> list[str]:
        color[name] = 1
        path.append(name)
        for upstream in inputs.get(name, []):
            if upstream not in inputs:
                continue
            if color.get(upstream) == 1:
                return path[path.index(upstream):]
            if upstream not in color and (cycle := visit(upstream)):
                return cycle
        color[name] = 2
        path.pop()
        return []

    for name in inputs:
        if name not in color and (cycle := visit(name)):
            return cycle
    return []


def step_order(spec: pb.PipelineSpec) -> list[str]:
    """Step names in an order where every step comes after the steps it reads (the spec's order
    among independent steps).

    Raises:
        InvalidArgument: the steps form a cycle.
    """
    cycle = find_cycle(spec)
    if cycle:
        raise InvalidArgument("steps", "the steps form a cycle: " + " -> ".join([*cycle, cycle[0]]))
    done: list[str] = []
    inputs = {step.name: list(step.inputs) for step in spec.steps}
    while len(done) < len(inputs):
        for name, upstream in inputs.items():
            if name not in done and all(u in done or u not in inputs for u in upstream):
                done.append(name)
                break
    return done
