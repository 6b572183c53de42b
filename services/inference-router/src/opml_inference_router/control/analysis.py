"""One measurement of a rollout's analysis: the new version against the stable one, check by check
(:mod:`opml_inference_router_contract.rollout_spec`), from the router's own measures over the same
interval (:class:`~opml_inference_router.routing.window.Measures`), a shadow step's comparisons
(:class:`~opml_inference_router.routing.shadow.ShadowMeasures`) and the monitoring-scorer's windows
(:class:`~opml_inference_router.control.quality.Quality`).

A check is INCONCLUSIVE below its minimum (``min_requests`` to either version, compared requests for
disagreement, ``min_predictions`` / ``min_labels`` of either version for the scorer's checks; or, for
p99, no request succeeded to read a latency from), FAILED when the new version is beyond its bound,
else PASSED. The router's own two checks fail beyond their bound only when the difference is not
chance (:mod:`.significance`): an error-rate increase by a one-sided two-proportion test, a p99 ratio
by the new version's latencies being larger overall (Mann-Whitney U, at the stricter
:data:`~.significance.LATENCY_SIGNIFICANCE`), or alone once both versions
have enough answers for their p99 to rest on ten. The stable version's p99 is the lower of this
interval's and the median of its last few intervals' (``stable_recent``): a stall of the host in
one interval inflates the stable version's p99 there and hid a slower new version for an interval
(4 of 15 rollouts of a 2x slower version took two). Beyond the bound only against that median,
the check fails only at :data:`~.significance.RECENT_SIGNIFICANCE` (the same interval's requests
of both, Mann-Whitney): a stall that lifts both versions' p99 at once does not move their
distributions apart, and a version really slower moves its whole distribution. The scorer's classifier checks fail beyond
their bound only when the accuracy drop is not chance either (the same test as error rates, on the
labels or scored predictions each value rests on). A measurement fails when any check fails, is inconclusive when any is (and none failed).
For the scorer's checks, ``new_requests``/``stable_requests`` of a result are the predictions (or
labels) each version's value rests on; for disagreement, the compared requests (stable: the same).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from opml_inference_router.control.quality import Quality
from opml_inference_router.control.significance import (
    LATENCY_SIGNIFICANCE,
    RECENT_SIGNIFICANCE,
    SELF_EVIDENT_P99_REQUESTS,
    SIGNIFICANCE,
    error_increase_p,
    slower_p,
)
from opml_inference_router.routing.shadow import ShadowMeasures
from opml_inference_router.routing.window import Measures
from opml_inference_router_contract.rollout_spec import (
    ACCURACY,
    DISAGREEMENT,
    ERROR_RATE,
    QUALITY_CHECKS,
    Analysis,
    Check,
)

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


_NO_QUALITY = Quality()


def measure(analysis: Analysis, new: Measures, stable: Measures, *, shadow: ShadowMeasures | None = None,
            new_quality: Quality = _NO_QUALITY, stable_quality: Quality = _NO_QUALITY,
            stable_recent: Sequence[float] = ()) -> tuple[str, list[CheckResult]]:
    """The measurement's verdict and each check's result (``shadow``: None without a mirror;
    ``stable_recent``: the stable version's p99 in each of its last few intervals)."""
    results = []
    for check in analysis.checks:
        if check.name == DISAGREEMENT:
            results.append(_disagreement(check, shadow or ShadowMeasures()))
        elif check.name in QUALITY_CHECKS:
            results.append(_quality(check, new_quality, stable_quality))
        else:
            results.append(_check(check, new, stable, stable_recent))
    return verdict_of(results), results


def verdict_of(results: list[CheckResult]) -> str:
    """A measurement's verdict from its checks': FAILED when any failed, else INCONCLUSIVE when any is."""
    verdicts = {result.verdict for result in results}
    return FAILED if FAILED in verdicts else INCONCLUSIVE if INCONCLUSIVE in verdicts else PASSED


def waiting(result: CheckResult, analysis: Analysis) -> bool:
    """Whether a scorer's check is inconclusive only because the scorer's windows have not brought
    its minimum yet (the evidence builds up over the step: :mod:`.progressive` judges the
    measurement without it until the analysis would pass)."""
    minimum = next((c.min_requests for c in analysis.checks if c.name == result.check), 0)
    return result.check in QUALITY_CHECKS and result.verdict == INCONCLUSIVE and \
        min(result.new_requests, result.stable_requests) < minimum


def unconfirmed(result: CheckResult, why: str) -> CheckResult:
    """A check whose evidence could not be confirmed at its source: inconclusive, its values kept."""
    return CheckResult(**{**result.to_dict(), "verdict": INCONCLUSIVE,
                          "reason": f"{result.reason}; not confirmed: {why}"})


def _disagreement(check: Check, shadow: ShadowMeasures) -> CheckResult:
    counts = {"check": check.name, "bound": check.bound, "new_requests": shadow.compared,
              "stable_requests": shadow.compared}
    if shadow.compared < check.min_requests:
        return CheckResult(verdict=INCONCLUSIVE, new_value=shadow.disagreement, stable_value=0.0, **counts,
                           reason=f"too few mirrored requests compared: {shadow.compared} (of {shadow.mirrored} "
                                  f"mirrored, {shadow.shed} shed, {shadow.failed} failed), fewer than "
                                  f"min_requests={check.min_requests}")
    share = shadow.disagreement
    verdict = FAILED if share > check.bound else PASSED
    extra = f", mean relative difference {shadow.mean_difference:.4f}" if shadow.mean_difference else ""
    return CheckResult(verdict=verdict, new_value=share, stable_value=0.0, **counts,
                       reason=f"outputs differ on {shadow.disagreed_rows} of {shadow.rows} rows of {shadow.compared} "
                              f"mirrored requests{extra}: a share of {share:.4f} "
                              f"{'>' if verdict == FAILED else '<='} max_share={check.bound:g}")


def _quality(check: Check, new: Quality, stable: Quality) -> CheckResult:
    """The scorer's estimate (estimated_accuracy) or truth (accuracy) of each version: the new one may
    be worse by ``max_drop`` (lower accuracy; for a regressor, higher MAE)."""
    truth = check.name == ACCURACY
    what, minimum = ("labels", "min_labels") if truth else ("scored predictions", "min_predictions")
    new_count, stable_count = (new.labels, stable.labels) if truth else (new.predictions, stable.predictions)
    new_value, stable_value = (new.accuracy, stable.accuracy) if truth else (new.estimate, stable.estimate)
    counts = {"check": check.name, "bound": check.bound, "new_requests": new_count, "stable_requests": stable_count}
    if min(new_count, stable_count) < check.min_requests or new_value is None or stable_value is None:
        return CheckResult(verdict=INCONCLUSIVE, new_value=new_value or 0.0, stable_value=stable_value or 0.0,
                           **counts, reason=f"too little evidence from the monitoring-scorer: {new_count} {what} of "
                                            f"the new version and {stable_count} of the stable one, fewer than "
                                            f"{minimum}={check.min_requests}")
    unit = "accuracy" if new.higher_is_better else "MAE"
    drop = (stable_value - new_value) if new.higher_is_better else (new_value - stable_value)
    verdict = FAILED if drop > check.bound else PASSED
    label = "true" if truth else "estimated"
    reason = (f"{label} {unit} {new_value:.4f} against {stable_value:.4f} ({new_count} and {stable_count} {what}): "
              f"worse by {drop:.4f} {'>' if verdict == FAILED else '<='} max_drop={check.bound:g}")
    if verdict == FAILED and new.higher_is_better and 0 <= min(new_value, stable_value) <= max(new_value, stable_value) <= 1:
        p = error_increase_p(round((1 - new_value) * new_count), new_count,
                             round((1 - stable_value) * stable_count), stable_count)
        verdict = FAILED if p < SIGNIFICANCE else PASSED
        reason += (f", and not chance (one-sided p={p:.2g} < {SIGNIFICANCE:g})" if verdict == FAILED
                   else f", but within chance at these counts (one-sided p={p:.2g} >= {SIGNIFICANCE:g})")
    return CheckResult(verdict=verdict, new_value=new_value, stable_value=stable_value, **counts, reason=reason)


def _check(check: Check, new: Measures, stable: Measures, stable_recent: Sequence[float]) -> CheckResult:
    counts = {"new_requests": new.requests, "stable_requests": stable.requests, "bound": check.bound,
              "check": check.name}
    if min(new.requests, stable.requests) < check.min_requests:
        return CheckResult(verdict=INCONCLUSIVE, new_value=0.0, stable_value=0.0, **counts,
                           reason=f"too little traffic: {new.requests} requests to the new version and "
                                  f"{stable.requests} to the stable one, fewer than min_requests={check.min_requests}")
    if check.name == ERROR_RATE:
        increase = new.error_rate - stable.error_rate
        reason = (f"error rate {new.error_rate:.4f} against {stable.error_rate:.4f}: an increase of {increase:.4f} "
                  f"{'>' if increase > check.bound else '<='} max_increase={check.bound:g}")
        verdict = PASSED
        if increase > check.bound:
            p = error_increase_p(new.errors, new.requests, stable.errors, stable.requests)
            verdict = FAILED if p < SIGNIFICANCE else PASSED
            reason += (f", and not chance (one-sided p={p:.2g} < {SIGNIFICANCE:g})" if verdict == FAILED
                       else f", but within chance at these counts (one-sided p={p:.2g} >= {SIGNIFICANCE:g})")
        return CheckResult(verdict=verdict, new_value=new.error_rate, stable_value=stable.error_rate, **counts,
                           reason=reason)
    if new.p99_s is None or stable.p99_s is None:
        return CheckResult(verdict=INCONCLUSIVE, new_value=new.p99_s or 0.0, stable_value=stable.p99_s or 0.0,
                           **counts, reason="no successful request to read a p99 latency from")
    stable_p99, recent = stable.p99_s, ""
    if stable_recent and statistics.median(stable_recent) < stable_p99:
        stable_p99 = statistics.median(stable_recent)
        recent = (f" (the median of the stable version's p99s in its last {len(stable_recent)} intervals; "
                  f"{stable.p99_s * 1000:.2f} ms in this one)")
    ratio = new.p99_s / stable_p99
    reason = (f"p99 latency {new.p99_s * 1000:.2f} ms against {stable_p99 * 1000:.2f} ms{recent}: a ratio of "
              f"{ratio:.2f} {'>' if ratio > check.bound else '<='} max_ratio={check.bound:g}")
    verdict = PASSED
    answered = min(sum(new.latencies), sum(stable.latencies))
    if new.p99_s / stable.p99_s > check.bound and answered >= SELF_EVIDENT_P99_REQUESTS:
        # against this interval's own p99 only: a stall of the host lifts both versions' then
        verdict, stable_p99 = FAILED, stable.p99_s
        reason = (f"p99 latency {new.p99_s * 1000:.2f} ms against {stable.p99_s * 1000:.2f} ms: a ratio of "
                  f"{new.p99_s / stable.p99_s:.2f} > max_ratio={check.bound:g}, on {answered} or more answers of "
                  f"each (a p99 that rests on ten or more)")
    elif ratio > check.bound:
        p = slower_p(new.latencies, stable.latencies)
        level = LATENCY_SIGNIFICANCE if new.p99_s / stable.p99_s > check.bound else RECENT_SIGNIFICANCE
        verdict = FAILED if p < level else PASSED
        reason += (f", and slower overall (Mann-Whitney one-sided p={p:.2g} < {level:g})"
                   if verdict == FAILED else
                   f", but not slower overall (Mann-Whitney one-sided p={p:.2g} >= {level:g}): the p99 of "
                   f"{answered} answers is a few slow ones, judged alone from {SELF_EVIDENT_P99_REQUESTS}")
    return CheckResult(verdict=verdict, new_value=new.p99_s, stable_value=stable_p99, **counts, reason=reason)
