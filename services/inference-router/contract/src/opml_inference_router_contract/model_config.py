"""The model config a bundle carries beside its ONNX file (``model.yaml``): what a model needs to be
served (``ModelConfig``), in the spirit of Triton's ``model_config.proto``.

It is the router's contract: whoever produces a model (an export, a training pipeline) writes a config
these rules accept and can check it with :func:`load_model_config` / ``ModelConfig.from_dict`` without
installing the router, which reads every bundle with the same schema. What a fleet offers (pool kinds
by their capabilities, pools of workers) is the router's own configuration
(``opml_inference_router.placement.fleet_config``), built on the rules here: a model names the pool
kinds it may run on, the fleet declares them. A proto version of these schemas will mirror the field
names and defaults documented here.

Every loader raises :class:`~opml_common.errors.InvalidArgument` whose field is the path of the
offending value (``inputs[0].dims[1]``, ``pool_kinds[2]``) and whose message states the rule and
shows the value; unknown fields and unknown enum values are refused, never ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Self, TypeVar, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from opml_common.errors import InvalidArgument, NotFound, brief
from opml_common.yamlsafe import load_yaml

Precision = Literal["fp32", "fp16", "bf16", "int8"]
"""Numeric precision a model may be served in and a pool kind can run."""

DataType = Literal[
    "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "fp16", "bf16", "fp32", "fp64", "string",
]
"""Tensor element type (Triton's ``DataType`` names without the ``TYPE_`` prefix, lower case)."""

PRECISIONS: tuple[str, ...] = get_args(Precision)

MAX_CONFIG_BYTES = 1 << 20
"""Largest model or fleet config file read (1 MiB; a real one is a few KiB)."""
MAX_CONFIG_NODES = 100_000
"""Most YAML nodes in a config, aliases counted as the nodes they expand to."""
MAX_CONFIG_DEPTH = 32
"""Deepest nesting of a config (its schemas nest 4 levels)."""

MAX_DEFAULT_TIMEOUT_MS = 600_000
"""Longest implicit deadline a model may set (10 minutes: longer is a hang, not a deadline)."""

_MODEL_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_TENSOR_NAME = r"^[A-Za-z_][A-Za-z0-9_./:-]{0,127}$"
_KIND_NAME = r"^[a-z][a-z0-9-]{0,31}$"

KindName = Annotated[StrictStr, Field(pattern=_KIND_NAME)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]


# ----------------------------------------------------------------------------------------------
# Rules every config the router reads follows (its fleet config is built on them too)


class RuleError(ValueError):
    """A rule broken by a value below the one being validated; ``subpath`` extends the error's path."""

    def __init__(self, subpath: Sequence[str | int], message: str) -> None:
        super().__init__(message)
        self.subpath = tuple(subpath)
        self.message = message


class Schema(BaseModel):
    """A config schema: unknown fields are refused and a parsed config is immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


_S = TypeVar("_S", bound=Schema)


def unique(values: Sequence[Any], what: str) -> None:
    """Raises: RuleError at the index of the first value seen before."""
    seen: set[Any] = set()
    for index, value in enumerate(values):
        if value in seen:
            raise RuleError([index], f"{what} must be unique, but {brief(value)} appears twice")
        seen.add(value)


# ----------------------------------------------------------------------------------------------
# Model configuration


class TensorSpec(Schema):
    """One input or output tensor. ``dims`` excludes the batch dimension when the model batches."""

    name: Annotated[StrictStr, Field(pattern=_TENSOR_NAME)]
    data_type: DataType
    dims: tuple[StrictInt, ...] = Field(
        (), description="Each dim is >= 1, or -1 for a dynamic size. Default: () (a scalar)."
    )

    @field_validator("dims")
    @classmethod
    def _dims_positive_or_dynamic(cls, dims: tuple[int, ...]) -> tuple[int, ...]:
        for index, dim in enumerate(dims):
            if dim != -1 and dim < 1:
                raise RuleError([index], f"must be >= 1, or -1 for a dynamic size, but got {dim}")
        return dims


class DynamicBatching(Schema):
    """Server-side batching: a batch is dispatched when it is full or its oldest request has waited
    ``max_queue_delay_us``; a request that finds its replica idle runs at once unless ``wait_when_idle``.
    Absent from a config: requests are served one by one."""

    max_queue_delay_us: StrictInt = Field(0, ge=0, description="Longest wait to fill a batch. Default 0.")
    wait_when_idle: StrictBool = Field(False, description="Wait up to max_queue_delay_us even when nothing is "
                                       "queued and no batch runs (Triton's dynamic batcher). Default false: such a "
                                       "request runs at once, and requests arriving meanwhile form the next batch.")

    @property
    def max_queue_delay_ms(self) -> float:
        return self.max_queue_delay_us / 1000.0


class LatencySlo(Schema):
    """The latency a model's callers are promised, measured at the server."""

    p99_ms: StrictFloat = Field(gt=0, description="99th percentile latency bound in milliseconds. Required.")


class LatestVersions(Schema):
    num_versions: PositiveInt = 1


class AllVersions(Schema):
    pass


class SpecificVersions(Schema):
    versions: tuple[PositiveInt, ...] = Field(min_length=1)

    @field_validator("versions")
    @classmethod
    def _versions_unique(cls, versions: tuple[int, ...]) -> tuple[int, ...]:
        unique(versions, "versions")
        return versions


_VERSION_NUMBER = re.compile(r"[0-9]{1,10}")


def version_number(text: str) -> int | None:
    """``text`` as a model version number (ASCII digits, >= 1), or None. Not ``str.isdigit``: it holds
    for "²", which ``int`` refuses (a user's version string would have been an internal error)."""
    if _VERSION_NUMBER.fullmatch(text) is None:
        return None
    return int(text) or None


class VersionPolicy(Schema):
    """Which versions of the model are served: exactly one of ``latest``, ``all``, ``specific``
    (Triton's ``version_policy`` oneof). Default: the latest version."""

    latest: LatestVersions | None = None
    all: AllVersions | None = None
    specific: SpecificVersions | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> Self:
        chosen = [name for name in ("latest", "all", "specific") if getattr(self, name) is not None]
        if len(chosen) != 1:
            raise ValueError(f"set exactly one of latest, all, specific, but got {chosen or 'none'}")
        return self

    def select(self, available: Sequence[int]) -> tuple[int, ...]:
        """The versions to serve out of ``available``, ascending.

        Raises:
            NotFound: ``specific`` names a version that is not available, or none is available.
        """
        versions = sorted(set(available))
        if not versions:
            raise NotFound("no version of the model is available")
        if self.latest is not None:
            return tuple(versions[-self.latest.num_versions:])
        if self.specific is not None:
            missing = sorted(set(self.specific.versions) - set(versions))
            if missing:
                raise NotFound(
                    f"version_policy.specific names versions {missing} that do not exist; available: {versions}"
                )
            return tuple(sorted(self.specific.versions))
        return tuple(versions)

    def keeps(self, serving: Sequence[int]) -> set[int]:
        """Which of the ``serving`` versions the policy keeps serving: unlike :meth:`select`, never
        raises (``specific`` may name versions not deployed yet; the serving ones it names are kept)."""
        if self.specific is not None:
            return set(serving) & set(self.specific.versions)
        return set(self.select(serving)) if serving else set()


class InstanceGroup(Schema):
    """``count`` replicas of each served version on ``pool_kind`` in ``precision`` (Triton's
    ``instance_group`` entry, with a pool kind for its ``kind``)."""

    pool_kind: KindName
    precision: Precision
    count: PositiveInt = Field(1, description="Replicas of the group, on distinct workers while the kind has "
                               "enough with room. Default 1.")


class ModelConfig(Schema):
    """What a model needs to be served; the bundle holds it beside the ONNX file."""

    name: Annotated[StrictStr, Field(pattern=_MODEL_NAME)]
    max_batch_size: StrictInt = Field(
        ge=0, description="Largest batch the model accepts; 0: the model has no batch dimension. Required."
    )
    inputs: tuple[TensorSpec, ...] = Field(min_length=1)
    outputs: tuple[TensorSpec, ...] = Field(min_length=1)
    dynamic_batching: DynamicBatching | None = Field(None, description="Default: none (one request per batch).")
    slo: LatencySlo
    expected_rate_rps: StrictFloat = Field(
        ge=0, description="Requests per second each served version is expected to receive. Required."
    )
    pool_kinds: tuple[KindName, ...] = Field(
        min_length=1, description="Pool kinds the model may run on, most preferred first. Required."
    )
    precisions: tuple[Precision, ...] = Field(
        ("fp32",), min_length=1, description="Precisions whose accuracy is acceptable (int8: quantized). Default: fp32."
    )
    version_policy: VersionPolicy = Field(default_factory=lambda: VersionPolicy(latest=LatestVersions()))
    min_replicas: StrictInt | None = Field(
        None, ge=1, description="Fewest replicas of each served version, on distinct workers while the pool kind "
        "has enough workers with room (N+1: losing one worker leaves a replica serving). Default: the fleet's "
        "min_replicas (2).")
    max_request_bytes: StrictInt | None = Field(
        None, ge=1, description="Largest serialized ModelInferRequest the router forwards for the model; longer "
        "ones are refused (INVALID_ARGUMENT) before any copy. Default: computed when every input has a fixed size "
        "(max_batch_size x dims x item size, + 64 KiB), else OPML_INFERENCE_ROUTER_MAX_REQUEST_BYTES (a BYTES "
        "input or a -1 dim); never above OPML_INFERENCE_ROUTER_GRPC_MAX_RECEIVE_BYTES.")
    default_timeout_ms: StrictFloat | None = Field(
        None, gt=0, le=MAX_DEFAULT_TIMEOUT_MS, description="Deadline of a request whose caller sets none, in "
        "milliseconds (a backend that answers slowly under load needs more than its SLO suggests). Default: "
        "4 x slo.p99_ms.")
    instance_groups: tuple[InstanceGroup, ...] | None = Field(
        None, min_length=1, description="Serve each version on several pool kinds at once: exactly these groups "
        "of replicas, each pool_kind among pool_kinds and precision among precisions, and traffic spread over all "
        "of them. Their counts are exact (the fleet's replica floor does not apply; min_replicas, when set, must "
        "be at most their sum). Default: none (the planner places each version on the one kind it chooses).")

    @field_validator("inputs", "outputs")
    @classmethod
    def _tensor_names_unique(cls, tensors: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
        for index, tensor in enumerate(tensors):
            if any(other.name == tensor.name for other in tensors[:index]):
                raise RuleError([index, "name"],
                                f"tensor names must be unique, but {brief(tensor.name)} appears twice")
        return tensors

    @field_validator("pool_kinds")
    @classmethod
    def _kinds_unique(cls, kinds: tuple[str, ...]) -> tuple[str, ...]:
        unique(kinds, "pool kinds")
        return kinds

    @field_validator("precisions")
    @classmethod
    def _precisions_unique(cls, precisions: tuple[str, ...]) -> tuple[str, ...]:
        unique(precisions, "precisions")
        return precisions

    @model_validator(mode="after")
    def _batching_needs_a_batch_dimension(self) -> Self:
        if self.dynamic_batching is not None and self.max_batch_size < 1:
            raise RuleError(
                ["dynamic_batching"], "needs max_batch_size >= 1, but max_batch_size is 0 (no batch dimension)"
            )
        return self

    @model_validator(mode="after")
    def _groups_within_kinds_and_precisions(self) -> Self:
        """Every broken rule of the groups at once (a config has few), each with its path."""
        if self.instance_groups is None:
            return self
        problems: list[tuple[list[str | int], str]] = []
        for index, group in enumerate(self.instance_groups):
            if group.pool_kind not in self.pool_kinds:
                problems.append(([index, "pool_kind"], f"must be one of pool_kinds ({', '.join(self.pool_kinds)}), "
                                                       f"but got {brief(group.pool_kind)}"))
            if group.precision not in self.precisions:
                problems.append(([index, "precision"], f"must be one of precisions ({', '.join(self.precisions)}), "
                                                       f"but got {brief(group.precision)}"))
            if any((other.pool_kind, other.precision) == (group.pool_kind, group.precision)
                   for other in self.instance_groups[:index]):
                problems.append(([index], f"groups must differ in pool_kind or precision, but "
                                          f"{group.pool_kind}/{group.precision} appears twice"))
        total = sum(group.count for group in self.instance_groups)
        if self.min_replicas is not None and total < self.min_replicas:
            problems.append(([], f"the groups' counts sum to {total}, below min_replicas {self.min_replicas}"))
        if problems:
            (subpath, message), others = problems[0], problems[1:]
            if others:
                message += f" (and {len(others)} more: " + "; ".join(
                    f"{_path(['instance_groups', *where])} {rule}" for where, rule in others) + ")"
            raise RuleError(["instance_groups", *subpath], message)
        return self

    @property
    def batch_limit(self) -> int:
        """Largest batch a replica may form: 1 without dynamic batching."""
        return max(1, self.max_batch_size) if self.dynamic_batching is not None else 1

    @property
    def queue_delay_ms(self) -> float:
        return self.dynamic_batching.max_queue_delay_ms if self.dynamic_batching is not None else 0.0

    @classmethod
    def from_dict(cls, data: Any) -> ModelConfig:
        """Raises: InvalidArgument naming the path of the first bad field."""
        return validate(cls, data)


# ----------------------------------------------------------------------------------------------
# Loading


def load_model_config(path: str | Path) -> ModelConfig:
    """Reads a model config from a YAML or JSON file.

    Raises:
        NotFound: the file does not exist.
        InvalidArgument: the file is not YAML/JSON, or a field breaks a rule (field = its path).
    """
    return ModelConfig.from_dict(read_document(Path(path)))


def read_document(path: Path) -> Any:
    """The file's value, read and parsed within :data:`MAX_CONFIG_BYTES`, :data:`MAX_CONFIG_NODES`
    and :data:`MAX_CONFIG_DEPTH` (a YAML alias bomb or a 50,000-deep document is refused while
    composing, before anything is built or validated)."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)  # never more than the limit, whatever the file
    except FileNotFoundError:
        raise NotFound(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise InvalidArgument(str(path), "must be a YAML or JSON file, but is a directory") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise InvalidArgument(str(path), f"must be at most {MAX_CONFIG_BYTES} bytes of YAML or JSON")
    return load_yaml(data, what=str(path), max_bytes=MAX_CONFIG_BYTES, max_nodes=MAX_CONFIG_NODES,
                     max_depth=MAX_CONFIG_DEPTH)


_MAX_LISTED = 5
"""Further problems a config error names besides the first (their count is always given)."""


def validate(schema: type[_S], data: Any) -> _S:
    """``data`` as a ``schema``.

    Raises:
        InvalidArgument: naming the path of the first bad field, and how many more there are.
    """
    if not isinstance(data, Mapping):
        raise InvalidArgument(schema.__name__, f"must be a mapping of fields, but got {type(data).__name__}")
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        details = error.errors(include_url=False)
        # A bad item also makes its container look too short; report only the most specific errors.
        # Linear in the number of errors: a location is dropped when it is a proper prefix of another.
        prefixes = {tuple(d["loc"][:cut]) for d in details for cut in range(len(d["loc"]))}
        specific = [d for d in details if tuple(d["loc"]) not in prefixes] or details
        field, message = _describe(specific[0])
        if len(specific) > 1:
            others = [_path(list(d["loc"])) for d in specific[1:1 + _MAX_LISTED]]
            more = ", ..." if len(specific) > 1 + _MAX_LISTED else ""
            message += f" (and {len(specific) - 1} more: {', '.join(others)}{more})"
        raise InvalidArgument(field, message) from None


def _describe(detail: Mapping[str, Any]) -> tuple[str, str]:
    """The path and a person-readable rule of one pydantic error."""
    location = list(detail["loc"])
    cause = detail.get("ctx", {}).get("error")
    if isinstance(cause, RuleError):
        return _path(location + list(cause.subpath)), cause.message
    kind = detail["type"]
    if kind == "missing":
        return _path(location), "is required"
    if kind == "extra_forbidden":
        return _path(location), "is not a field of this schema"
    if kind == "value_error":
        return _path(location), str(cause) if cause is not None else detail["msg"]
    message = re.sub(r"^Input should be", "must be", detail["msg"])
    message = re.sub(r"^String should", "must", message)
    message = re.sub(r"^Tuple should", "must", message)
    return _path(location), f"{message}, but got {_show(detail.get('input'))}"


def _show(value: Any) -> str:
    return brief(value, limit=80)


def _path(location: Sequence[str | int]) -> str:
    path = ""
    for part in location:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "config"
