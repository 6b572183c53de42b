"""How the router treats one model: limits, deadlines, backup requests, retries, canary stickiness."""

from __future__ import annotations

from dataclasses import dataclass

from opml_common.errors import InvalidArgument
from opml_inference_router.routing.limits import DEFAULT_MAX_REQUEST_BYTES, RequestLimit, request_limit
from opml_inference_router_contract.model_config import ModelConfig


@dataclass(frozen=True, kw_only=True)
class ModelPolicy:
    """Routing settings of one model (all versions), checked on construction.

    Every field is a keyword with a default, so a control plane sets only what it knows; use
    :meth:`for_model` to derive them from a model's :class:`ModelConfig` (its SLO).
    """

    slo_p99_ms: float = 100.0
    """The latency promised to callers; the source of the defaults below."""
    default_timeout_ms: float | None = None
    """Deadline of a request whose caller set none (``model.yaml``'s ``default_timeout_ms``). Default:
    4 x ``slo_p99_ms``."""
    max_concurrency: int = 64
    """Requests of the model in flight across its replicas; more wait in the queue."""
    max_queue: int = 256
    """Requests allowed to wait for a slot; beyond it they are refused with RESOURCE_EXHAUSTED."""
    selection: str = "p2c"
    """``p2c`` (power of two choices) or ``least`` (least outstanding requests)."""
    hedge: bool = True
    """Send a backup request to a second replica when the first is slow (DLIS, "The Tail at Scale")."""
    hedge_slo_fraction: float = 0.5
    """Backup delay while a replica has too few latency samples: this fraction of the SLO."""
    hedge_min_delay_ms: float = 1.0
    """Backup delay floor: a backup is sent after max(this, the replica's observed p95 latency)."""
    hedge_budget: float = 0.1
    """Backups allowed per request on average (a token bucket), so hedging never doubles the load."""
    max_attempts: int = 3
    """Replicas tried per request after failures (the first try included; backups not counted)."""
    eject_s: float = 1.0
    """How long a replica that failed (unreachable, killed) is skipped; doubled per repeated failure."""
    sticky_canary: bool = False
    """Assign requests to versions by a hash of their id instead of at random."""
    max_request: RequestLimit | None = None
    """Longest serialized ModelInferRequest forwarded (:mod:`.limits`); longer ones are INVALID_ARGUMENT
    before any copy. None: the router's default. :meth:`for_model` computes it from the config."""

    def __post_init__(self) -> None:
        _check(self.slo_p99_ms > 0, "slo_p99_ms", "must be > 0", self.slo_p99_ms)
        _check(self.default_timeout_ms is None or self.default_timeout_ms > 0, "default_timeout_ms",
               "must be > 0 (or unset: 4 x slo_p99_ms)", self.default_timeout_ms)
        _check(self.max_concurrency >= 1, "max_concurrency", "must be >= 1", self.max_concurrency)
        _check(self.max_queue >= 0, "max_queue", "must be >= 0", self.max_queue)
        _check(self.selection in ("p2c", "least"), "selection", "must be 'p2c' or 'least'", self.selection)
        _check(0 < self.hedge_slo_fraction <= 1, "hedge_slo_fraction", "must be in (0, 1]", self.hedge_slo_fraction)
        _check(self.hedge_min_delay_ms >= 0, "hedge_min_delay_ms", "must be >= 0", self.hedge_min_delay_ms)
        _check(0 <= self.hedge_budget <= 1, "hedge_budget", "must be in [0, 1]", self.hedge_budget)
        _check(self.max_attempts >= 1, "max_attempts", "must be >= 1", self.max_attempts)
        _check(self.eject_s > 0, "eject_s", "must be > 0", self.eject_s)

    @property
    def default_timeout_s(self) -> float:
        return (self.default_timeout_ms if self.default_timeout_ms is not None else 4 * self.slo_p99_ms) / 1000.0

    def default_deadline_passed(self) -> str:
        """Why a request whose caller set no deadline ran out of time: the model's default, and its source
        (a caller told only "deadline exceeded" would look for a deadline it never set)."""
        source = ("from model.yaml" if self.default_timeout_ms is not None
                  else f"4 x its p99 SLO of {self.slo_p99_ms:g} ms")
        return (f"no deadline from the caller: the model's default_timeout_ms ({self.default_timeout_s * 1000:g} ms, "
                f"{source}) passed; set a deadline on the request or default_timeout_ms in model.yaml")

    @classmethod
    def for_model(cls, config: ModelConfig, *, replicas: int = 1,
                  default_max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, **overrides: object) -> ModelPolicy:
        """Defaults for a model: its SLO and default deadline, a concurrency limit of what its replicas
        can batch, two batches each (``replicas x batch_limit x 2``: one running, one forming; at least 8), a queue
        at the router of at least 256 (four times the limit when that is more), and the request size
        its config allows (``default_max_request_bytes`` where the config fixes none).

        The queue's length only bounds memory: admission prices each wait against the SLO and the
        deadline, and sheds the requests that would miss them."""
        concurrency = in_flight_limit(replicas * config.batch_limit)
        settings: dict[str, object] = {"slo_p99_ms": float(config.slo.p99_ms),
                                       "default_timeout_ms": config.default_timeout_ms, "max_concurrency": concurrency,
                                       "max_queue": queue_limit(concurrency),
                                       "max_request": request_limit(config, default=default_max_request_bytes)}
        settings.update(overrides)
        return cls(**settings)  # type: ignore[arg-type]


def in_flight_limit(rows: int) -> int:
    """Requests in flight for replicas that batch ``rows`` rows in all: two batches' worth, at least 8
    (a request waiting for a restarting replica holds its slot: a few must not block the rest)."""
    return max(8, 2 * rows)


def queue_limit(in_flight: int) -> int:
    """Requests that may wait at the router beside ``in_flight``: a memory bound, not the admission rule."""
    return max(256, 4 * in_flight)


def _check(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise InvalidArgument(field, f"{rule}, but got {value!r}")
