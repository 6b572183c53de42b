"""One measurement of a rollout's analysis: the new version against the stable one over the same
interval, check by check (:mod:`opml_inference_router_contract.rollout_spec`), from the router's own
measures (:class:`~opml_inference_router.routing.window.Measures`).

A check is INCONCLUSIVE when either version served fewer than its ``min_requests`` (or, for p99, no
request succeeded to read a latency from), FAILED when the new version is beyond its bound, else
PASSED. A measurement fails when any check fails, is inconclusive when any is (and none failed).
"""

from __future__ import annotations

from dataclasses import dataclass

from opml_inference_router.routing.window import Measures
from opml_inference_router_contract.rollout_spec import ERROR_RATE, Analysis, Check

PASSED, FAILED, INCONCLUSIVE = "PASSED", "FAILED", "INCONCLUSIVE"


@dataclass(frozen=True)
class CheckResult:
    """A check's verdict with its evidence: each version's requests and value, the bound, and why."""

    check: str
    verdict: str
    new_value: float
    stable_value: float
    bound: float
    new_requests: int
    stable_requests: int
    reason: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def measure(analysis: Analysis, new: Measures, stable: Measures) -> tuple[str, list[CheckResult]]:
    """The measurement's verdict and each check's result."""
    results = [_check(check, new, stable) for check in analysis.checks]
    verdicts = {result.verdict for result in results}
    verdict = FAILED if FAILED in verdicts else INCONCLUSIVE if INCONCLUSIVE in verdicts else PASSED
    return verdict, results


def _check(check: Check, new: Measures, stable: Measures) -> CheckResult:
    counts = {"new_requests": new.requests, "stable_requests": stable.requests, "bound": check.bound,
              "check": check.name}
    if min(new.requests, stable.requests) < check.min_requests:
        return CheckResult(verdict=INCONCLUSIVE, new_value=0.0, stable_value=0.0, **counts,
                           reason=f"too little traffic: {new.requests} requests to the new version and "
                                  f"{stable.requests} to the stable one, fewer than min_requests={check.min_requests}")
    if check.name == ERROR_RATE:
        increase = new.error_rate - stable.error_rate
        verdict = FAILED if increase > check.bound else PASSED
        return CheckResult(verdict=verdict, new_value=new.error_rate, stable_value=stable.error_rate, **counts,
                           reason=f"error rate {new.error_rate:.4f} against {stable.error_rate:.4f}: an increase "
                                  f"of {increase:.4f} {'>' if verdict == FAILED else '<='} max_increase={check.bound:g}")
    if new.p99_s is None or stable.p99_s is None:
        return CheckResult(verdict=INCONCLUSIVE, new_value=new.p99_s or 0.0, stable_value=stable.p99_s or 0.0,
                           **counts, reason="no successful request to read a p99 latency from")
    ratio = new.p99_s / stable.p99_s
    verdict = FAILED if ratio > check.bound else PASSED
    return CheckResult(verdict=verdict, new_value=new.p99_s, stable_value=stable.p99_s, **counts,
                       reason=f"p99 latency {new.p99_s * 1000:.2f} ms against {stable.p99_s * 1000:.2f} ms: a ratio "
                              f"of {ratio:.2f} {'>' if verdict == FAILED else '<='} max_ratio={check.bound:g}")
