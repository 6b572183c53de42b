"""The checks a deploy makes before it acts: its arguments, and the pool kinds a model's config
allows against the fleet this router runs."""

from __future__ import annotations

from opml_common.errors import FailedPrecondition, InvalidArgument
from opml_inference_router.placement import Fleet
from opml_inference_router_contract.model_config import ModelConfig

MAX_VERSION = 2**31 - 1
"""The highest version number: a model's versions travel as int64 in events and requests, and the next
one is always the highest given + 1, so an unbounded number given once would leave no next one."""


def deploy_arguments(version: int, canary_percent: float) -> InvalidArgument | None:
    """The first problem with a deploy's arguments, or None."""
    if not 0 <= version <= MAX_VERSION:
        return InvalidArgument("version", f"must be in [1, {MAX_VERSION}], or 0 for the next version, "
                                          f"but got {version}")
    if not 0 <= canary_percent < 100:
        return InvalidArgument("canary_percent", f"must be in [0, 100) (0: all traffic), but got {canary_percent}")
    return None


def check_pool_kinds(config: ModelConfig, fleet: Fleet, unavailable_kinds: list[str]) -> None:
    """Raises:
        InvalidArgument: the config names a pool kind the fleet does not declare, or an instance group a
            precision its kind does not run.
        FailedPrecondition: none of its kinds has workers on this router.
    """
    for index, kind in enumerate(config.pool_kinds):
        if kind not in fleet.kinds:
            raise InvalidArgument(f"pool_kinds[{index}]", f"must be a kind the fleet declares "
                                                          f"({', '.join(fleet.kinds)}), but got {kind!r}")
    wrong = [(f"instance_groups[{index}].precision", f"must be a precision pool kind {group.pool_kind} runs "
              f"({', '.join(fleet.kinds[group.pool_kind].precisions)}), but got {group.precision!r}")
             for index, group in enumerate(config.instance_groups or ())
             if group.precision not in fleet.kinds[group.pool_kind].precisions]  # its kinds are declared: above
    if wrong:
        (field, message), others = wrong[0], wrong[1:]
        more = f" (and {len(others)} more: " + "; ".join(f"{f} {m}" for f, m in others) + ")" if others else ""
        raise InvalidArgument(field, message + more)
    if not any(fleet.workers_of(kind) for kind in config.pool_kinds):
        running = ", ".join(sorted({worker.kind.name for worker in fleet.workers}))
        raise FailedPrecondition(f"model {config.name} may run on {', '.join(config.pool_kinds)}, but this "
                                 f"router runs workers of {running} only (unavailable here: "
                                 f"{', '.join(unavailable_kinds) or 'none'})")
