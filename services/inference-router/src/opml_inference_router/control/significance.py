"""Whether a difference between the new version and the stable one is evidence or noise.

A rollout measures both versions over the same interval, often a few hundred requests each. The p99
of 200 requests is the third slowest, so one stall of a loaded host moves it by any factor, and 3
errors in 200 against 0 is an "increase" of 1.5 points that a fair coin makes often: judged by the
bound alone, a version identical to the stable one (an A/A rollout) was rolled back in about one
analysis in eight on a loaded 2-core machine. As Kayenta judges canaries (a Mann-Whitney U test
with an effect size), a check here fails only when the difference is beyond its bound *and*
unlikely to be chance: a one-sided test at :data:`SIGNIFICANCE`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SIGNIFICANCE = 0.01
"""The one-sided p-value under which a difference beyond a check's bound fails the check."""
LATENCY_SIGNIFICANCE = 0.001
"""The one-sided p-value under which a p99 ratio beyond its bound fails (Mann-Whitney): stricter than
:data:`SIGNIFICANCE`, as an interval's latencies are not independent draws: a stall of one worker
slows a run of one version's requests together, which the test reads as a shift. At 0.01 an A/A
analysis failed 3 of 203 measurements at load 8-9 (p = 0.0004, 0.0018, 0.0027); a version 2x slower
throughout is far below either level (p < 1e-20 on 200 requests each)."""
RECENT_SIGNIFICANCE = 1e-6
"""The p-value a p99 ratio beyond its bound only against the stable version's recent p99 (not this
interval's, which a stall inflated) must be under. Stricter: in a stall long enough to lift a p99 by
20x, one version's requests (its worker) may be hit harder than the other's, which the test reads
as a real difference (an A/A measurement failed so at p=0.00017 in the bench); a version 2x slower
throughout is far below it (p < 1e-20 on 200 requests each)."""
SELF_EVIDENT_P99_REQUESTS = 1000
"""Successful requests of each version from which a p99 rests on ten requests or more: a ratio beyond
the bound is then judged alone, so a version slower only in its tail (the same median) is caught."""


def _upper_tail(z: float) -> float:
    """P(Z >= z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2))


def error_increase_p(new_errors: int, new_requests: int, stable_errors: int, stable_requests: int) -> float:
    """One-sided p-value that the new version's error rate is no higher than the stable one's (the
    pooled two-proportion z-test, with continuity correction); 1.0 when neither failed."""
    pooled = (new_errors + stable_errors) / (new_requests + stable_requests)
    if pooled in (0.0, 1.0):
        return 1.0
    spread = math.sqrt(pooled * (1 - pooled) * (1 / new_requests + 1 / stable_requests))
    correction = 0.5 * (1 / new_requests + 1 / stable_requests)
    difference = new_errors / new_requests - stable_errors / stable_requests
    return _upper_tail((difference - correction) / spread)


def slower_p(new: Sequence[int], stable: Sequence[int]) -> float:
    """One-sided p-value that the new version's latencies are not stochastically larger than the
    stable one's: the Mann-Whitney U test on two histograms of the same buckets (a bucket's requests
    tie with each other), normal approximation with tie and continuity corrections; 1.0 when either
    has no latency."""
    n_new, n_stable = sum(new), sum(stable)
    if not n_new or not n_stable:
        return 1.0
    u = 0.0
    below = 0  # stable requests in buckets below the current one
    ties = 0.0
    for new_count, stable_count in zip(new, stable, strict=True):
        u += new_count * (below + 0.5 * stable_count)
        below += stable_count
        tied = new_count + stable_count
        ties += tied ** 3 - tied
    total = n_new + n_stable
    variance = n_new * n_stable / 12 * ((total + 1) - ties / (total * (total - 1)))
    if variance <= 0:  # every request of both in one bucket: no difference to see
        return 1.0
    return _upper_tail((u - n_new * n_stable / 2 - 0.5) / math.sqrt(variance))
