"""A federation's configuration: a YAML document, validated with every wrong field path at once.

The document is read with :func:`opml_common.yamlsafe.load_yaml` (bounded size, nodes and depth;
syntax errors with line and column), then checked against :class:`FederationConfig`. Every field
that breaks a rule is reported in one :class:`~opml_common.errors.InvalidArgument` naming its path
(``strategy.eta: must be > 0``; ``selection.tiers: ...``), followed by the rules that tie fields
together (``selection.clients_per_round`` cannot exceed ``min_clients``...). The strategy and the
selector are built from it here, so the service, the simulator and the bench build them the same.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from opml_common.errors import InvalidArgument
from opml_common.yamlsafe import load_yaml
from opml_fl_coordinator.selection import RandomSelection, Selection, TiflSelection
from opml_fl_coordinator.strategy import (
    BoundedInfluence,
    DifferentialPrivacyFixedClipping,
    FedAdam,
    FedAvg,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    FedYogi,
    Strategy,
)
from opml_fl_coordinator.strategy.base import Config, EvaluateFn

MAX_CONFIG_BYTES = 64 * 1024
NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DifferentialPrivacy(_Strict):
    noise_multiplier: float = Field(ge=0, description="Noise std in units of the clipping norm per client.")
    clipping_norm: float = Field(gt=0, description="Largest L2 norm of one client's update.")


class _StrategyBase(_Strict):
    min_fit_results: int = Field(1, ge=1, description="Fewest usable updates a round needs (else the model stays).")
    differential_privacy: DifferentialPrivacy | None = Field(None, description="Clip updates and add noise.")


class FedAvgConfig(_StrategyBase):
    name: Literal["fedavg"]


class FedProxConfig(_StrategyBase):
    name: Literal["fedprox"]
    proximal_mu: float = Field(0.01, ge=0, description="Weight of the clients' proximal term.")


class FedOptConfig(_StrategyBase):
    name: Literal["fedadam", "fedyogi"]
    eta: float = Field(0.1, gt=0, description="Server learning rate.")
    beta_1: float = Field(0.9, ge=0, lt=1)
    beta_2: float = Field(0.99, ge=0, lt=1)
    tau: float = Field(1e-3, gt=0)


class TrimmedMeanConfig(_StrategyBase):
    name: Literal["trimmed_mean"]
    beta: float = Field(0.2, ge=0, lt=0.5, description="Fraction cut at each end, per coordinate.")


class MedianConfig(_StrategyBase):
    name: Literal["median"]


StrategyConfig = Annotated[FedAvgConfig | FedProxConfig | FedOptConfig | TrimmedMeanConfig | MedianConfig,
                           Field(discriminator="name")]
_STRATEGY_TAGS = {"fedavg", "fedprox", "fedadam", "fedyogi", "trimmed_mean", "median"}


class SelectionConfig(_Strict):
    policy: Literal["random", "tifl"] = Field("random", description="random: FedAvg's uniform sample; tifl: "
                                              "tiers by speed, tier chosen from per-tier accuracy and credits.")
    clients_per_round: int = Field(4, ge=1, description="Clients asked to train each round.")
    tiers: int = Field(3, ge=1, le=32, description="TiFL: number of speed tiers.")
    credits_per_tier: int | None = Field(None, ge=1, description="TiFL: rounds each tier may be chosen "
                                         "(unset: unlimited).")
    tier_interval: int = Field(3, ge=1, description="TiFL: rounds between re-tiering and new tier probabilities.")


class SemiAsyncConfig(_Strict):
    buffer_size: int = Field(3, ge=1, description="Updates aggregated together (FedBuff's K).")
    concurrency: int = Field(6, ge=1, description="Clients training at once.")
    staleness_exponent: float = Field(0.5, ge=0, description="Update weight (1 + staleness) ** -a.")
    max_staleness: int = Field(8, ge=0, description="Updates older than this many versions are refused.")


class LocalTraining(_Strict):
    epochs: int = Field(1, ge=1, le=1000)
    batch_size: int = Field(32, ge=1, le=1 << 16)
    learning_rate: float = Field(0.05, gt=0, le=10)


class ValidationConfig(_Strict):
    max_update_norm: float | None = Field(None, gt=0, description="Refuse updates whose change is larger.")
    norm_outlier_factor: float = Field(5.0, gt=1, description="Refuse updates whose change exceeds this many "
                                       "times the median of recent ones.")
    max_examples: int = Field(10_000_000, ge=1, description="Largest example count (dataset size) a client may "
                              "declare when it joins; an update may claim its declaration times the epochs.")


class RobustConfig(_Strict):
    clip_factor: float = Field(2.0, ge=1, description="Each update's change is clipped to this many times the "
                               "round's median change.")
    weight_factor: float = Field(3.0, ge=1, description="Each update's example count is capped at this many "
                                 "times the round's median count.")


class ModelSpec(_Strict):
    hidden_activation: Literal["relu", "tanh", "sigmoid", "linear"] = Field(
        "relu", description="Activation of the members' hidden dense layers (the last is a softmax): the "
        "global model is exported to ONNX with it.")


class HoldoutRef(_Strict):
    context: str = Field(min_length=1, description="bundle-store context of the held-out set's bundle.")
    bundle: str = Field(min_length=1, description="The bundle (name: its newest committed version, or UUID) "
                        "holding holdout.npz: x [rows, features] numbers, y [rows] class indices.")


class FederationConfig(_Strict):
    name: str = Field(description="Federation name: lowercase letters, digits and '-', at most 63.",
                      pattern=NAME.pattern)
    rounds: int = Field(10, ge=1, le=100_000, description="Aggregations to run.")
    min_clients: int = Field(2, ge=1, description="Clients that must have joined before the first round.")
    round_deadline_s: float = Field(60.0, gt=0, le=86_400, description="A round closes this long after it "
                                    "started, whoever has not answered.")
    stragglers: Literal["drop", "partial"] = Field("drop", description="drop: late updates are left out; "
                                                   "partial: clients get the time budget and send what they did.")
    mode: Literal["sync", "semi_async"] = "sync"
    semi_async: SemiAsyncConfig = SemiAsyncConfig()
    strategy: StrategyConfig = FedAvgConfig(name="fedavg")
    selection: SelectionConfig = SelectionConfig()
    local: LocalTraining = LocalTraining()
    validation: ValidationConfig = ValidationConfig()
    trust: Literal["untrusted", "trusted"] = Field("untrusted", description="untrusted: every update's influence "
                                                   "is bounded (robust); trusted: the strategy alone.")
    robust: RobustConfig = RobustConfig()
    target_accuracy: float | None = Field(None, gt=0, le=1, description="Stop once the global model reaches it.")
    seed: int = Field(0, ge=0, description="Seed of selection (and DP noise).")
    model: ModelSpec = ModelSpec()
    holdout: HoldoutRef | None = Field(None, description="Held-out rows the operator holds: each published "
                                       "model carries its outputs on them as the scorer's reference set (so it "
                                       "is monitored with a performance estimate) and its accuracy on them.")
    serve: bool | None = Field(None, description="Tag the published ONNX models serve=true, so the "
                               "inference-router deploys each as it is committed; unset: the service's "
                               "SERVE_MODELS.")


def _path(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc]
    if len(parts) > 1 and parts[0] == "strategy" and parts[1] in _STRATEGY_TAGS:
        parts.pop(1)  # the union's tag is not a field of the document
    return ".".join(parts) or "config"


def _rule(problem: Mapping[str, Any]) -> str:
    message = str(problem["msg"]).removeprefix("Value error, ")
    if problem["type"] == "extra_forbidden":
        return "is not a known field"
    if problem["type"] == "union_tag_invalid":
        return f"name must be one of {sorted(_STRATEGY_TAGS)}"
    return message[:1].lower() + message[1:]


def _cross_field(config: FederationConfig) -> list[tuple[str, str]]:
    problems = []
    if config.selection.clients_per_round > config.min_clients:
        problems.append(("selection.clients_per_round", f"must be <= min_clients ({config.min_clients}), but got "
                         f"{config.selection.clients_per_round}"))
    if config.mode == "semi_async" and config.semi_async.buffer_size > config.semi_async.concurrency:
        problems.append(("semi_async.buffer_size", f"must be <= semi_async.concurrency "
                         f"({config.semi_async.concurrency}), but got {config.semi_async.buffer_size}"))
    if config.strategy.min_fit_results > config.selection.clients_per_round and config.mode == "sync":
        problems.append(("strategy.min_fit_results", f"must be <= selection.clients_per_round "
                         f"({config.selection.clients_per_round}), but got {config.strategy.min_fit_results}"))
    if config.trust == "trusted" and "robust" in config.model_fields_set:
        problems.append(("robust", "applies to untrusted federations only, but trust is 'trusted'"))
    if config.strategy.min_fit_results > config.semi_async.buffer_size and config.mode == "semi_async":
        problems.append(("strategy.min_fit_results", f"must be <= semi_async.buffer_size "
                         f"({config.semi_async.buffer_size}): a version aggregates one buffer, but got "
                         f"{config.strategy.min_fit_results}"))
    return problems


def parse_config(source: str | bytes | Mapping[str, Any], *, what: str = "config") -> FederationConfig:
    """The federation described by ``source`` (YAML text or the mapping it loads to).

    Raises:
        InvalidArgument: every field that breaks a rule, by path (``strategy.eta``), all at once;
            or field ``what`` when the text is too big or not YAML (with line and column).
    """
    document = source if isinstance(source, Mapping) else load_yaml(source, what=what, max_bytes=MAX_CONFIG_BYTES)
    if not isinstance(document, Mapping):
        raise InvalidArgument(what, f"must be a mapping of fields, but got {type(document).__name__}")
    try:
        config = FederationConfig.model_validate(dict(document))
    except ValidationError as error:
        violations = [(_path(p["loc"]), _rule(p)) for p in error.errors(include_url=False, include_input=False)]
        raise InvalidArgument.of(violations) from None
    problems = _cross_field(config)
    if problems:
        raise InvalidArgument.of(problems)
    return config


def build_strategy(config: FederationConfig, *, evaluate_fn: EvaluateFn | None = None) -> Strategy:
    """The strategy the config names, with the local-training settings as each round's client config;
    in an untrusted federation (the default) wrapped in :class:`BoundedInfluence`, outermost, so
    differential privacy's fixed clipping sees updates already bounded."""
    spec = config.strategy
    local = config.local

    def fit_config(server_round: int) -> Config:
        return {"epochs": local.epochs, "batch_size": local.batch_size, "learning_rate": local.learning_rate}

    common: dict[str, Any] = {"min_fit_results": spec.min_fit_results, "on_fit_config_fn": fit_config,
                              "evaluate_fn": evaluate_fn}
    strategy: Strategy
    if isinstance(spec, FedProxConfig):
        strategy = FedProx(proximal_mu=spec.proximal_mu, **common)
    elif isinstance(spec, FedOptConfig):
        kind = FedAdam if spec.name == "fedadam" else FedYogi
        strategy = kind(eta=spec.eta, beta_1=spec.beta_1, beta_2=spec.beta_2, tau=spec.tau, **common)
    elif isinstance(spec, TrimmedMeanConfig):
        strategy = FedTrimmedAvg(beta=spec.beta, **common)
    elif isinstance(spec, MedianConfig):
        strategy = FedMedian(**common)
    else:
        strategy = FedAvg(**common)
    if spec.differential_privacy is not None:
        per_round = (config.semi_async.buffer_size if config.mode == "semi_async"
                     else config.selection.clients_per_round)
        strategy = DifferentialPrivacyFixedClipping(
            strategy, noise_multiplier=spec.differential_privacy.noise_multiplier,
            clipping_norm=spec.differential_privacy.clipping_norm, num_sampled_clients=per_round, seed=config.seed)
    if config.trust == "untrusted":
        strategy = BoundedInfluence(strategy, clip_factor=config.robust.clip_factor,
                                    weight_factor=config.robust.weight_factor)
    return strategy


def build_selection(config: FederationConfig) -> Selection:
    """The selection policy the config names, seeded by ``config.seed``."""
    spec = config.selection
    if spec.policy == "tifl":
        return TiflSelection(clients_per_round=spec.clients_per_round, tiers=spec.tiers,
                             credits_per_tier=spec.credits_per_tier, tier_interval=spec.tier_interval, seed=config.seed)
    return RandomSelection(clients_per_round=spec.clients_per_round, seed=config.seed)
