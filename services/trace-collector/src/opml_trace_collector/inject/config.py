"""The tracer's settings, read inside the job with the standard library only.

Pydantic costs a traced job ~70 ms of CPU to import, for a dozen variables. ``FIELDS`` is the one
definition of the ``OPML_TRACE_*`` names, defaults, bounds and descriptions: ``read`` applies it
here, and ``settings.TracerSettings`` (pydantic, for the shipper, the CLI and the config doc) is
built from it; a test checks both accept and refuse the same values. ``read`` also takes the four
platform variables the job needs (where the broker and Redis are), with ``PlatformSettings``' rules.
Errors name the variable and the rule; they never show the Redis URL, which may hold a password.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PREFIX = "OPML_TRACE_"


@dataclass(frozen=True)
class Spec:
    """One setting: its type (str, float, int, Path, or str | None as ``optional_str``), default and bounds."""

    kind: type
    default: object
    description: str
    min_length: int | None = None
    gt: float | None = None
    ge: float | None = None
    optional: bool = False
    regex: bool = False  # the value must compile as a regular expression


FIELDS: dict[str, Spec] = {
    "job": Spec(str, "adhoc", "Job name; events are keyed `<job>/<worker>`.", min_length=1),
    "worker": Spec(str, "local", "Worker name, e.g. `worker-0` (from TF_CONFIG) or `local`.", min_length=1),
    "spool_dir": Spec(Path, Path("~/.opml/trace-spool"), "Where a traced job writes its events (one folder per run, "
                      "under one per broker and topic prefix); the host's shipper publishes them from there."),
    "session_dir": Spec(Path, Path("opml-traces"), "Where the JSON-lines session file of the run's events is written."),
    "flush_interval_s": Spec(float, 2.0, "Period of the step-metrics batches.", gt=0),
    "poll_s": Spec(float, 1.0, "Period of the control poll (global on/off, capture requests).", gt=0),
    "exit_timeout_s": Spec(float, 0.1, "At exit, the most the job waits for the shipper to deliver its last "
                           "events (already in the spool); what is not delivered by then stays in the spool, "
                           "and the shipper sends it later.", ge=0),
    "bucket": Spec(str, "opml-traces", "S3 bucket of captured traces.", min_length=3),
    "max_trace_events": Spec(int, 200_000, "Most events one captured trace keeps (ops first).", ge=100),
    "op_filter": Spec(str, None, "Regex: a capture keeps only ops whose name or type matches.", optional=True,
                      regex=True),
    "upload_retry_s": Spec(float, 300.0, "While S3 cannot be reached, how long a finished capture's upload is "
                           "retried (the trace waits on local disk); keep it under the collector's capture "
                           "timeout, after which the capture expires anyway.", ge=0),
    "shipper_idle_exit_s": Spec(float, 60.0, "A shipper started by the launcher exits after this long with no run "
                                "to ship and no launcher running a job (0: never); the next traced run starts another.", ge=0),
}


class ConfigError(ValueError):
    """Invalid settings; the message names every bad variable and its rule."""


@dataclass(frozen=True)
class TracerConfig:
    """What the tracer in a job runs with (the fields of ``FIELDS`` plus the platform's four)."""

    job: str
    worker: str
    spool_dir: Path
    session_dir: Path
    flush_interval_s: float
    poll_s: float
    exit_timeout_s: float
    bucket: str
    max_trace_events: int
    op_filter: str | None
    upload_retry_s: float
    shipper_idle_exit_s: float
    kafka_bootstrap: str = "127.0.0.1:9092"
    topic_prefix: str = ""
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "opml:"

    @property
    def subject(self) -> str:
        return f"{self.job}/{self.worker}"

    @property
    def outlet(self) -> Path:
        """This broker's and topic prefix's folder of the spool (see ``outlet_dir``)."""
        return outlet_dir(self.spool_dir, self.kafka_bootstrap, self.topic_prefix)


def outlet_dir(spool_dir: Path, kafka_bootstrap: str, topic_prefix: str) -> Path:
    """The spool's folder for one destination: events go where their job's settings said, whichever
    shipper runs (a shipper publishes only the folder of its own broker and topic prefix)."""
    digest = hashlib.sha256(f"{kafka_bootstrap}\n{topic_prefix}".encode()).hexdigest()[:12]
    return spool_dir / digest


def convert(name: str, spec: Spec, raw: str) -> object:
    """``raw`` as ``spec`` types and bounds it.

    Raises:
        ValueError: the message says the rule (the variable's name is added by ``read``).
    """
    if spec.optional and raw == "":
        return None
    if spec.kind is float or spec.kind is int:
        try:
            value = spec.kind(raw.strip())
        except ValueError:
            value = _integral(raw) if spec.kind is int else None  # "1000.0" is 1000, as pydantic reads it
            if value is None:
                raise ValueError(f"must be {'an integer' if spec.kind is int else 'a number'}, but got {raw!r}") from None
        if spec.kind is float and not math.isfinite(value):
            raise ValueError(f"must be a finite number, but got {raw!r}")
        if spec.gt is not None and not value > spec.gt:
            raise ValueError(f"must be > {spec.gt:g}, but got {raw!r}")
        if spec.ge is not None and not value >= spec.ge:
            raise ValueError(f"must be >= {spec.ge:g}, but got {raw!r}")
        return value
    if spec.kind is Path:
        return Path(raw).expanduser()
    if spec.min_length is not None and len(raw) < spec.min_length:
        raise ValueError(f"must have at least {spec.min_length} character{'s' if spec.min_length > 1 else ''}")
    if spec.regex:
        try:
            re.compile(raw)
        except re.error as exc:
            raise ValueError(f"must be a valid regular expression, but {raw!r} fails: {exc}") from exc
    return raw


def _integral(raw: str) -> int | None:
    """A whole number written with a fraction of zeros ("1000.0"), which pydantic takes as an int."""
    text = raw.strip()
    return int(float(text)) if re.fullmatch(r"[+-]?\d+(_\d+)*\.0*", text) else None


def _platform(environ: Mapping[str, str], problems: list[str]) -> dict[str, str]:
    """The platform variables the job needs, checked as ``PlatformSettings`` checks them."""
    values = {"kafka_bootstrap": environ.get("OPML_KAFKA_BOOTSTRAP", "127.0.0.1:9092"),
              "topic_prefix": environ.get("OPML_TOPIC_PREFIX", ""),
              "redis_url": environ.get("OPML_REDIS_URL", "redis://127.0.0.1:6379/0"),
              "redis_prefix": environ.get("OPML_REDIS_PREFIX", "opml:")}
    for server in values["kafka_bootstrap"].split(","):
        host, _, port = server.strip().rpartition(":")
        if not host or not port.isdigit():
            problems.append(f"OPML_KAFKA_BOOTSTRAP: each server must be host:port, but got {server!r}")
    if not values["redis_url"].startswith(("redis://", "rediss://", "unix://")):
        problems.append("OPML_REDIS_URL: must start with redis://, rediss:// or unix:// (value not shown: it may "
                        "hold a password)")
    return values


def read(environ: Mapping[str, str] | None = None) -> TracerConfig:
    """The settings from ``environ`` (default: the process's), unset variables at their defaults.

    Raises:
        ConfigError: one line per invalid variable.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    problems: list[str] = []
    for name, spec in FIELDS.items():
        variable = PREFIX + name.upper()
        raw = environ.get(variable)
        if raw is None:
            default = spec.default
            values[name] = default.expanduser() if isinstance(default, Path) else default
            continue
        try:
            values[name] = convert(name, spec, raw)
        except ValueError as exc:
            problems.append(f"{variable}: {exc}")
    values.update(_platform(environ, problems))
    if problems:
        raise ConfigError("; ".join(problems))
    return TracerConfig(**values)
