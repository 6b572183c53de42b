"""Job specs: a YAML document (or a dict) -> the ``opml.jobs.v1.JobSpec`` message -> what the
orchestrator runs (:class:`~opml_job_orchestrator.orchestrator.JobDefinition`).

The YAML mirrors the message, with three spellings people expect: ``class`` (``job_class``),
``cpu`` in cores or millicores (``2``, ``0.5``, ``500m``) and ``memory`` with a unit (``512Mi``,
``2Gi``; a bare number is MiB). Every error is an ``InvalidArgument`` naming the field path,
the value and the rule (``roles.worker.resources.gpu: must be an integer >= 0, but got -1``), so
the CLI can say it before a request is sent and the service says it again for any client.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from opml.jobs.v1 import jobs_pb2 as pb

from opml_common.errors import InvalidArgument
from opml_common.yamlsafe import load_yaml
from opml_job_orchestrator.executor.base import JobProgram
from opml_job_orchestrator.executor.tony import ORCHESTRATOR_VARIABLES
from opml_job_orchestrator.orchestrator import JobDefinition
from opml_job_orchestrator.scheduler.model import ROLE_NAMES, JobClass, JobSpec, Resources, RoleSpec

_JOB_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
_MEMORY_UNITS = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 ** 2,
                 "K": 1000 / 1024 ** 2, "M": 1000 ** 2 / 1024 ** 2, "G": 1000 ** 3 / 1024 ** 2}
_TOP_KEYS = {"name", "class", "priority", "command", "roles", "env", "max_retries", "checkpoint", "trace",
             "heartbeat_timeout_seconds"}
_ROLE_KEYS = {"replicas", "resources", "command"}
_RESOURCE_KEYS = {"cpu", "memory", "gpu"}
_CHECKPOINT_KEYS = {"dir", "interval_seconds", "restart_overhead_seconds"}
_CLASSES = {"TE": pb.JOB_CLASS_TE, "BE": pb.JOB_CLASS_BE}


def load_spec(source: str | Mapping[str, Any]) -> pb.JobSpec:
    """Parse a YAML job spec (text, or the mapping it loads to) into a ``JobSpec`` message.

    Checks shapes and units here; the rules of the job itself (replicas, roles, sizes) are
    :func:`definition_from_proto`'s, which the service applies to every submit.

    Raises:
        InvalidArgument: the YAML does not parse or is too big (bytes, nodes, depth: field
            ``spec``), a key is unknown, or a value has the wrong type or unit; the field path names it.
    """
    if isinstance(source, str):
        source = load_yaml(source, what="spec")  # bounded: size, nodes (aliases expanded), depth
    doc = _mapping(source, "spec", _TOP_KEYS)
    spec = pb.JobSpec(name=_string(doc.get("name", ""), "name"),
                      priority=_integer(doc.get("priority", 0), "priority"),
                      command=_argv(doc.get("command", []), "command"),
                      trace=_boolean(doc.get("trace", False), "trace"),
                      heartbeat_timeout_seconds=_number(doc.get("heartbeat_timeout_seconds", 0),
                                                        "heartbeat_timeout_seconds"))
    job_class = doc.get("class")
    if job_class is not None:
        if not isinstance(job_class, str) or job_class.upper() not in _CLASSES:
            raise InvalidArgument("class", f"must be TE or BE, but got {job_class!r}")
        spec.job_class = _CLASSES[job_class.upper()]
    if "max_retries" in doc:
        spec.max_retries = _integer(doc["max_retries"], "max_retries")
    for key, value in _mapping(doc.get("env", {}), "env", None).items():
        spec.env[str(key)] = _string(value if not isinstance(value, int | float) or isinstance(value, bool)
                                     else str(value), f"env.{key}")
    for role, body in _mapping(doc.get("roles", {}), "roles", None).items():
        field = f"roles.{role}"
        body = _mapping(body, field, _ROLE_KEYS)
        message = spec.roles[str(role)]
        message.replicas = _integer(body.get("replicas", 1), f"{field}.replicas")
        message.command.extend(_argv(body.get("command", []), f"{field}.command"))
        resources = _mapping(body.get("resources", {}), f"{field}.resources", _RESOURCE_KEYS)
        message.resources.cpu_millis = _cpu_millis(resources.get("cpu", 0), f"{field}.resources.cpu")
        message.resources.memory_mib = _memory_mib(resources.get("memory", 0), f"{field}.resources.memory")
        message.resources.gpu = _integer(resources.get("gpu", 0), f"{field}.resources.gpu")
    checkpoint = _mapping(doc.get("checkpoint", {}), "checkpoint", _CHECKPOINT_KEYS)
    spec.checkpoint.dir = _string(checkpoint.get("dir", ""), "checkpoint.dir")
    spec.checkpoint.interval_seconds = _number(checkpoint.get("interval_seconds", 0), "checkpoint.interval_seconds")
    spec.checkpoint.restart_overhead_seconds = _number(checkpoint.get("restart_overhead_seconds", 0),
                                                       "checkpoint.restart_overhead_seconds")
    return spec


PLATFORM_ENV_PREFIXES = ("OPML_", "LD_", "DYLD_")
"""A spec's env may set no variable starting so: the orchestrator's and the platform's (``OPML_*``:
the job's id, its heartbeat file, where the tracer reports and with what credentials), and the
dynamic loader's; except :data:`JOB_TUNABLE_PREFIXES`."""
JOB_TUNABLE_PREFIXES = ("OPML_TRACE_",)
"""The tracer's own settings (spool and session dirs, flush interval...), the job's to tune; but not
:data:`LAUNCHER_VARIABLES`."""
LAUNCHER_VARIABLES = frozenset({"OPML_TRACE_JOB", "OPML_TRACE_WORKER", "OPML_TRACE_NESTED"})
"""What the trace launcher sets to name the traced task."""
PLATFORM_ENV_NAMES = frozenset({"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONEXECUTABLE",
                                *ORCHESTRATOR_VARIABLES, *LAUNCHER_VARIABLES})
"""Nor these: what changes which code the tracer and the interpreter load, and what the orchestrator
and the launcher set."""
_ENV_RULE = ("is set by the platform and may not be set by a job (refused: OPML_* but the tracer's OPML_TRACE_* "
             "settings, LD_*, DYLD_*, PYTHONPATH, PYTHONHOME, PYTHONSTARTUP, PYTHONUSERBASE, PYTHONEXECUTABLE, "
             "TF_CONFIG, OPML_TRACE_JOB/WORKER/NESTED)")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_env(env: Mapping[str, str], field: str = "env") -> None:
    """Refuse a spec's env that would override the platform's (every offending variable at once).

    Raises:
        InvalidArgument: each violation names ``{field}.{NAME}`` and the rule.
    """
    violations = []
    for name in env:
        upper = name.upper()
        if not _ENV_NAME.fullmatch(name):
            violations.append((f"{field}.{name}", "must be a variable name ([A-Za-z_][A-Za-z0-9_]*)"))
        elif upper in PLATFORM_ENV_NAMES or (upper.startswith(PLATFORM_ENV_PREFIXES)
                                             and not upper.startswith(JOB_TUNABLE_PREFIXES)):
            violations.append((f"{field}.{name}", _ENV_RULE))
    if violations:
        raise InvalidArgument.of(violations)


def definition_from_proto(spec: pb.JobSpec, *, submitter: str | None = None, check_job_env: bool = True
                          ) -> JobDefinition:
    """The orchestrator's view of a submitted spec: the scheduler's JobSpec, the JobProgram, the
    retry budget, and who submitted it (``submitter``: the caller's principal, set by the service,
    never taken from the request).

    ``check_job_env`` refuses an env that overrides the platform's (:func:`check_env`); a job saved
    before that rule is restored without it (``False``).

    Raises:
        InvalidArgument: a rule is broken; the field path is the message's (``roles.ps.replicas``,
            ``env.LD_PRELOAD``).
    """
    if check_job_env:
        check_env(spec.env)
    if not _JOB_NAME.fullmatch(spec.name):
        raise InvalidArgument("name", f"must match [a-z0-9][a-z0-9._-]{{0,127}}, but got {spec.name!r}")
    if spec.job_class == pb.JOB_CLASS_UNSPECIFIED:
        raise InvalidArgument("job_class", "must be TE (trial-and-error) or BE (best-effort), but is unset")
    if not spec.roles:
        raise InvalidArgument("roles", f"must name at least one of {list(ROLE_NAMES)}, but is empty")
    roles: dict[str, RoleSpec] = {}
    commands: dict[str, list[str]] = {}
    for role, body in spec.roles.items():
        field = f"roles.{role}"
        if role not in ROLE_NAMES:
            raise InvalidArgument(field, f"role {role!r} is not one of {list(ROLE_NAMES)}")
        commands[role] = list(body.command or spec.command)
        if not commands[role]:
            raise InvalidArgument(f"{field}.command", "is empty and so is the job's `command`; set one of them")
        roles[role] = RoleSpec(body.replicas, Resources(body.resources.cpu_millis, body.resources.memory_mib,
                                                        body.resources.gpu))
    if spec.HasField("max_retries") and spec.max_retries < 0:
        raise InvalidArgument("max_retries", f"must be >= 0, but got {spec.max_retries}")
    interval = _seconds(spec.checkpoint.interval_seconds, "checkpoint.interval_seconds")
    overhead = _seconds(spec.checkpoint.restart_overhead_seconds, "checkpoint.restart_overhead_seconds")
    heartbeat = _seconds(spec.heartbeat_timeout_seconds, "heartbeat_timeout_seconds")
    job_class = JobClass.TE if spec.job_class == pb.JOB_CLASS_TE else JobClass.BE
    scheduler_spec = JobSpec(job_id=spec.name, job_class=job_class, roles=roles, priority=spec.priority,
                             checkpoint_interval_s=interval or None, restart_overhead_s=overhead)
    program = JobProgram(commands=commands, env=dict(spec.env), checkpoint_dir=spec.checkpoint.dir or None,
                         heartbeat_timeout_s=heartbeat or None, trace=spec.trace)
    return JobDefinition(scheduler_spec, program, spec.max_retries if spec.HasField("max_retries") else None,
                         submitter)


def definition_to_proto(definition: JobDefinition) -> pb.JobSpec:
    """The inverse of :func:`definition_from_proto`, every role with its own command."""
    spec, program = definition.spec, definition.program
    message = pb.JobSpec(
        name=spec.job_id, job_class=pb.JOB_CLASS_TE if spec.job_class is JobClass.TE else pb.JOB_CLASS_BE,
        priority=spec.priority, env=dict(program.env), trace=program.trace,
        heartbeat_timeout_seconds=program.heartbeat_timeout_s or 0.0,
        checkpoint=pb.Checkpoint(dir=program.checkpoint_dir or "", interval_seconds=spec.checkpoint_interval_s or 0.0,
                                 restart_overhead_seconds=spec.restart_overhead_s))
    for role, role_spec in spec.roles.items():
        resources = role_spec.resources
        message.roles[role].CopyFrom(pb.RoleSpec(
            replicas=role_spec.replicas, command=list(program.commands[role]),
            resources=pb.Resources(cpu_millis=resources.cpu_millis, memory_mib=resources.memory_mib,
                                   gpu=resources.gpu)))
    if definition.max_retries is not None:
        message.max_retries = definition.max_retries
    return message


# -- YAML shapes and units -----------------------------------------------------------------------

def _mapping(value: Any, field: str, keys: set[str] | None) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidArgument(field, f"must be a mapping, but got {_short(value)}")
    if keys is not None:
        unknown = sorted(map(str, set(value) - keys))
        if unknown:
            raise InvalidArgument(f"{field}.{unknown[0]}" if field != "spec" else unknown[0],
                                  f"is not a known key; expected one of {sorted(keys)}")
    return value


def _string(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(field, f"must be a string, but got {_short(value)}")
    return value


def _boolean(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(field, f"must be true or false, but got {_short(value)}")
    return value


def _integer(value: Any, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not -2 ** 31 <= value < 2 ** 31:
        raise InvalidArgument(field, f"must be an integer, but got {_short(value)}")
    return value


def _number(value: Any, field: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidArgument(field, f"must be a number, but got {_short(value)}")
    return float(value)


def _argv(value: Any, field: str) -> list[str]:
    if isinstance(value, str):
        raise InvalidArgument(field, f"must be a list of strings (an argv), e.g. [python, train.py], "
                                     f"but got the string {_short(value)}")
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise InvalidArgument(field, f"must be a list of strings (an argv), but got {_short(value)}")
    return value


def _cpu_millis(value: Any, field: str) -> int:
    """``2`` or ``0.5`` cores, or ``500m`` millicores, to millicores."""
    if isinstance(value, str) and re.fullmatch(r"\d+m", value.strip()):
        return int(value.strip()[:-1])
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise InvalidArgument(field, f"must be cores (2, 0.5) or millicores (500m), but got {value!r}") from None
    millis = _number(value, field) * 1000
    if millis != int(millis):
        raise InvalidArgument(field, f"must be a whole number of millicores, but got {value!r}")
    return int(millis)


def _memory_mib(value: Any, field: str) -> int:
    """``512`` (MiB), ``512Mi``, ``2Gi``, ``1G`` to MiB (rounded up)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]i?)?", value.strip()) if isinstance(value, str) else None
    if match is None or (match[2] or "Mi") not in _MEMORY_UNITS:
        raise InvalidArgument(field, f"must be MiB (512) or a quantity with a unit (512Mi, 2Gi, 1G), "
                                     f"but got {_short(value)}")
    return math.ceil(float(match[1]) * _MEMORY_UNITS[match[2] or "Mi"])


def _seconds(value: float, field: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(field, f"must be a finite number of seconds >= 0 (0: none), but got {value!r}")
    return value


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
