"""Job specs as other services and users write them: a YAML document (or a dict) -> the
``opml.jobs.v1.JobSpec`` message, and the rules of a job that the orchestrator applies to every submit.

``secret_env`` is ``env`` whose values are secrets (a scoped credential the submitter hands the job):
the orchestrator gives them to the job's tasks and shows them to nobody (no reply, event or log line
holds them); no error here quotes an env value either.

The YAML mirrors the message, with three spellings people expect: ``class`` (``job_class``),
``cpu`` in cores or millicores (``2``, ``0.5``, ``500m``) and ``memory`` with a unit (``512Mi``,
``2Gi``; a bare number is MiB). Every error is an ``InvalidArgument`` naming the field path,
the value and the rule (``roles.worker.resources.gpu: must be an integer >= 0, but got -1``), so
a client can say it before a request is sent and the service says it again for any client. A spec
with several mistakes gets them all in one error (``InvalidArgument.of``: one violation per field
path; shapes and units first, then the job's rules), never one per round trip.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from opml.jobs.v1 import jobs_pb2 as pb

from opml_common.errors import InvalidArgument
from opml_common.yamlsafe import load_yaml

ROLE_NAMES = ("chief", "worker", "ps", "evaluator")
"""TF_CONFIG task types, in the order placements and messages list them."""

SINGLE_REPLICA_ROLES = frozenset({"chief", "evaluator"})
"""TensorFlow runs at most one chief and one evaluator per job."""

ORCHESTRATOR_VARIABLES = frozenset({"TF_CONFIG"})
"""Variables the orchestrator sets itself besides ``OPML_*``: a spec's env may not set them."""

_JOB_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
_MEMORY_UNITS = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 ** 2,
                 "K": 1000 / 1024 ** 2, "M": 1000 ** 2 / 1024 ** 2, "G": 1000 ** 3 / 1024 ** 2}
_TOP_KEYS = {"name", "class", "priority", "command", "roles", "env", "secret_env", "max_retries", "checkpoint",
             "trace", "heartbeat_timeout_seconds", "labels"}
_LABEL_KEY = re.compile(r"[a-z0-9][a-z0-9./_-]{0,62}")
MAX_LABELS = 16
_ROLE_KEYS = {"replicas", "resources", "command"}
_RESOURCE_KEYS = {"cpu", "memory", "gpu"}
_CHECKPOINT_KEYS = {"dir", "interval_seconds", "restart_overhead_seconds"}
_CLASSES = {"TE": pb.JOB_CLASS_TE, "BE": pb.JOB_CLASS_BE}


def load_spec(source: str | Mapping[str, Any], *, what: str = "spec") -> pb.JobSpec:
    """Parse a YAML job spec (text, or the mapping it loads to) into a ``JobSpec`` message.

    Checks shapes and units here; the rules of the job itself (replicas, roles, sizes) are
    :func:`rule_violations`, which the service applies to every submit. When a shape is
    wrong, the rules are checked too on what could be read, so one error lists every mistake.

    Args:
        source: the YAML text, or the mapping it loads to.
        what: where the text came from (the CLI passes the file's path); a YAML syntax error, or
            a document too big, is reported on this field, with its line and column.

    Raises:
        InvalidArgument: the YAML does not parse or is too big (bytes, nodes, depth: field
            ``what``), or keys are unknown, or values have the wrong type or unit: one violation per
            field path, every one found.
    """
    if isinstance(source, str):
        source = load_yaml(source, what=what)  # bounded: size, nodes (aliases expanded), depth
    if not isinstance(source, Mapping):
        raise InvalidArgument("spec", f"must be a mapping, but got {_short(source)}")
    found = _Violations()
    doc = found.mapping(source, "spec", _TOP_KEYS)
    spec = pb.JobSpec(name=found.check(_string, doc.get("name", ""), "name", default=""),
                      priority=found.check(_integer, doc.get("priority", 0), "priority", default=0),
                      command=found.check(_argv, doc.get("command", []), "command", default=[_UNREAD]),
                      trace=found.check(_boolean, doc.get("trace", False), "trace", default=False),
                      heartbeat_timeout_seconds=found.check(_number, doc.get("heartbeat_timeout_seconds", 0),
                                                            "heartbeat_timeout_seconds", default=0.0))
    job_class = doc.get("class")
    if job_class is not None:
        if not isinstance(job_class, str) or job_class.upper() not in _CLASSES:
            found.add("class", f"must be TE or BE, but got {_short(job_class)}")
            found.aliases["job_class"] = "class"
        else:
            spec.job_class = _CLASSES[job_class.upper()]
    if "max_retries" in doc:
        spec.max_retries = found.check(_integer, doc["max_retries"], "max_retries", default=0)
    for field in ("env", "secret_env"):
        target = getattr(spec, field)
        for key, value in found.mapping(doc.get(field, {}), field, None).items():
            target[str(key)] = found.check(
                _string, value if not isinstance(value, int | float) or isinstance(value, bool) else str(value),
                f"{field}.{key}", default="")
    for key, value in found.mapping(doc.get("labels", {}), "labels", None).items():
        spec.labels[str(key)] = found.check(_string, value if not isinstance(value, int | float) or isinstance(
            value, bool) else str(value), f"labels.{key}", default="")
    for role, body in found.mapping(doc.get("roles", {}), "roles", None).items():
        field = f"roles.{role}"
        body = found.mapping(body, field, _ROLE_KEYS)
        message = spec.roles[str(role)]
        message.replicas = found.check(_integer, body.get("replicas", 1), f"{field}.replicas", default=1)
        message.command.extend(found.check(_argv, body.get("command", []), f"{field}.command", default=[_UNREAD]))
        resources = found.mapping(body.get("resources", {}), f"{field}.resources", _RESOURCE_KEYS)
        message.resources.cpu_millis = found.check(_cpu_millis, resources.get("cpu", 0), f"{field}.resources.cpu",
                                                   default=0)
        message.resources.memory_mib = found.check(_memory_mib, resources.get("memory", 0),
                                                   f"{field}.resources.memory", default=0)
        message.resources.gpu = found.check(_integer, resources.get("gpu", 0), f"{field}.resources.gpu", default=0)
    checkpoint = found.mapping(doc.get("checkpoint", {}), "checkpoint", _CHECKPOINT_KEYS)
    spec.checkpoint.dir = found.check(_string, checkpoint.get("dir", ""), "checkpoint.dir", default="")
    spec.checkpoint.interval_seconds = found.check(_number, checkpoint.get("interval_seconds", 0),
                                                   "checkpoint.interval_seconds", default=0.0)
    spec.checkpoint.restart_overhead_seconds = found.check(_number, checkpoint.get("restart_overhead_seconds", 0),
                                                           "checkpoint.restart_overhead_seconds", default=0.0)
    if found:
        # Say the job's rules too, on what could be read, but nothing about a field already reported
        # (a value that could not be read was replaced by a placeholder that breaks no rule).
        found.extend(rule_violations(spec))
        found.raise_all()
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


def rule_violations(spec: pb.JobSpec, *, check_job_env: bool = True) -> list[tuple[str, str]]:
    """Every rule of the job itself that ``spec`` breaks, as (field path, rule) in message order.

    ``check_job_env`` refuses an env that overrides the platform's (:func:`check_env`) and a NUL byte
    in what a task's process is given (env values, commands, ``checkpoint.dir``); the orchestrator
    restores a job saved before these rules without them."""
    violations: list[tuple[str, str]] = []
    if check_job_env:
        for field in ("env", "secret_env"):
            try:
                check_env(getattr(spec, field), field)
            except InvalidArgument as error:
                violations.extend(error.violations)
        violations.extend((f"secret_env.{name}", "is also in env; a variable is set in one of them")
                          for name in sorted(set(spec.env) & set(spec.secret_env)))
        violations.extend(_nul_violations(spec))
    if len(spec.labels) > MAX_LABELS:
        violations.append(("labels", f"must hold at most {MAX_LABELS} labels, but has {len(spec.labels)}"))
    for key, value in sorted(spec.labels.items()):
        if not _LABEL_KEY.fullmatch(key):
            violations.append((f"labels.{key[:70]}", "key must match [a-z0-9][a-z0-9./_-]{0,62}"))
        elif len(value) > 63:
            violations.append((f"labels.{key}", f"must be at most 63 characters, but has {len(value)}"))
    if not _JOB_NAME.fullmatch(spec.name):
        violations.append(("name", f"must match [a-z0-9][a-z0-9._-]{{0,127}}, but got {spec.name!r}"))
    if spec.job_class == pb.JOB_CLASS_UNSPECIFIED:
        violations.append(("job_class", "must be TE (trial-and-error) or BE (best-effort), but is unset"))
    if not spec.roles:
        violations.append(("roles", f"must name at least one of {list(ROLE_NAMES)}, but is empty"))
    for role in roles_in_order(spec):
        body, field = spec.roles[role], f"roles.{role}"
        if role not in ROLE_NAMES:
            violations.append((field, f"role {role!r} is not one of {list(ROLE_NAMES)}"))
            continue
        if not (body.command or spec.command):
            violations.append((f"{field}.command", "is empty and so is the job's `command`; set one of them"))
        if role in SINGLE_REPLICA_ROLES and body.replicas != 1:
            violations.append((f"{field}.replicas", f"must be 1 (TensorFlow runs one per job), but got {body.replicas}"))
        elif body.replicas < 1:
            violations.append((f"{field}.replicas", f"must be an integer >= 1, but got {body.replicas}"))
        amounts = {"cpu_millis": body.resources.cpu_millis, "memory_mib": body.resources.memory_mib,
                   "gpu": body.resources.gpu}
        negative = [(name, amount) for name, amount in amounts.items() if amount < 0]
        for name, amount in negative:
            violations.append((f"{field}.resources.{name.partition('_')[0]}", f"must be an integer >= 0, but got {amount}"))
        if not negative and not any(amounts.values()):
            violations.append((f"{field}.resources", "must request some CPU, memory or GPU, but every amount is 0"))
    if spec.HasField("max_retries") and spec.max_retries < 0:
        violations.append(("max_retries", f"must be >= 0, but got {spec.max_retries}"))
    for value, field in ((spec.checkpoint.interval_seconds, "checkpoint.interval_seconds"),
                         (spec.checkpoint.restart_overhead_seconds, "checkpoint.restart_overhead_seconds"),
                         (spec.heartbeat_timeout_seconds, "heartbeat_timeout_seconds")):
        if not math.isfinite(value) or value < 0:
            violations.append((field, f"must be a finite number of seconds >= 0 (0: none), but got {value!r}"))
    return violations

def roles_in_order(spec: pb.JobSpec) -> list[str]:
    """The roles ``spec`` names, known ones in :data:`ROLE_NAMES` order, then unknown ones by name."""
    return sorted(spec.roles, key=lambda name: (ROLE_NAMES.index(name) if name in ROLE_NAMES
                                               else len(ROLE_NAMES), name))


def _nul_violations(spec: pb.JobSpec) -> list[tuple[str, str]]:
    """The fields of what a task's process is given (argv, environment) that hold a NUL byte, which
    no process can be given (its value is not shown: an env value may be a credential)."""
    given = [(f"env.{name}", (value,)) for name, value in sorted(spec.env.items())]
    given += [(f"secret_env.{name}", (value,)) for name, value in sorted(spec.secret_env.items())]
    given += [("checkpoint.dir", (spec.checkpoint.dir,)), ("command", spec.command)]
    given += [(f"roles.{role}.command", spec.roles[role].command) for role in sorted(spec.roles)]
    return [(field, "must not contain a NUL byte (\\x00): no process can be given one")
            for field, strings in given if any("\0" in string for string in strings)]


# -- YAML shapes and units -----------------------------------------------------------------------

_UNREAD = "<unread>"
"""Stands for an argv that could not be read, so the rules do not also call it empty."""


class _Violations:
    """Collects every (field path, rule) a spec breaks, so :func:`load_spec` reports them all at once.

    ``aliases`` maps a rule's field to the YAML key already reported for it (``job_class`` ->
    ``class``), so the same mistake is not reported twice under two names.
    """

    def __init__(self) -> None:
        self.violations: list[tuple[str, str]] = []
        self.aliases: dict[str, str] = {}

    def __bool__(self) -> bool:
        return bool(self.violations)

    def add(self, field: str, rule: str) -> None:
        self.violations.append((field, rule))

    def check(self, parse: Any, value: Any, field: str, *, default: Any) -> Any:
        """``parse(value, field)``, or ``default`` when it raises (the violation is kept)."""
        try:
            return parse(value, field)
        except InvalidArgument as error:
            self.violations.extend(error.violations)
            return default

    def mapping(self, value: Any, field: str, keys: set[str] | None) -> Mapping[str, Any]:
        """``value`` as a mapping, its known keys only (each unknown key and a non-mapping reported)."""
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.add(field, f"must be a mapping, but got {_short(value)}")
            return {}
        if keys is None:
            return value
        prefix = "" if field == "spec" else f"{field}."
        for key in value:
            if str(key) not in keys:
                self.add(f"{prefix}{key}", f"is not a known key; expected one of {sorted(keys)}")
        return {key: item for key, item in value.items() if str(key) in keys}

    def extend(self, violations: list[tuple[str, str]]) -> None:
        """Add rule violations about fields not reported yet (nor fields under or above one)."""
        reported = [field for field, _ in self.violations]
        for field, rule in violations:
            field_as_read = self.aliases.get(field, field)
            if not any(_related(field_as_read, other) for other in reported):
                self.add(field, rule)

    def raise_all(self) -> None:
        raise InvalidArgument.of(self.violations)


def _related(field: str, other: str) -> bool:
    """One path is the other, or under it (``roles.worker`` and ``roles.worker.resources.cpu``)."""
    return field == other or field.startswith(other + ".") or other.startswith(field + ".")


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


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_cpu_millis(value: Any, field: str) -> int:
    """A CPU amount as job specs and Kubernetes write it (``2``, ``0.5``, ``500m``) in millicores.

    Raises:
        InvalidArgument: on ``field``, when it is no such amount.
    """
    return _cpu_millis(value, field)


def parse_memory_mib(value: Any, field: str) -> int:
    """A memory amount (``512``, ``512Mi``, ``2Gi``, ``1G``) in MiB, rounded up.

    Raises:
        InvalidArgument: on ``field``, when it is no such amount.
    """
    return _memory_mib(value, field)
