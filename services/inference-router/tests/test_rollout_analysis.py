"""A rollout's measurement: the router's per-version window and the checks that judge it."""

from __future__ import annotations

import pytest

from opml_inference_router.control.analysis import measure
from opml_inference_router.routing.window import Measures, OutcomeWindow
from opml_inference_router_contract.rollout_spec import Analysis, Check

ANALYSIS = Analysis(interval_s=1, checks=(Check("error_rate", 0.01, min_requests=10),
                                          Check("p99_latency", 1.5, min_requests=10)))


def test_the_window_counts_failures_reads_a_p99_within_5_percent_and_starts_over_on_take():
    window = OutcomeWindow()
    for index in range(1000):
        window.answered(0.001 if index < 985 else 0.050)
    window.failed("INTERNAL")
    window.failed("CANCELLED")  # the caller gave up: says nothing of the version
    measures = window.take()
    assert (measures.requests, measures.errors) == (1001, 1)
    assert 0.050 <= measures.p99_s <= 0.050 * 1.05
    assert window.take() == Measures(0, 0, None)


def test_a_measurement_passes_fails_or_is_inconclusive_with_its_evidence():
    stable = Measures(requests=100, errors=1, p99_s=0.010)
    verdict, results = measure(ANALYSIS, Measures(100, 1, 0.012), stable)
    assert verdict == "PASSED" and [r.verdict for r in results] == ["PASSED", "PASSED"]

    verdict, results = measure(ANALYSIS, Measures(100, 5, 0.030), stable)
    assert verdict == "FAILED"
    error_rate, latency = results
    assert (error_rate.new_value, error_rate.stable_value, error_rate.bound) == (0.05, 0.01, 0.01)
    assert latency.verdict == "FAILED" and latency.new_value / latency.stable_value == pytest.approx(3.0)
    assert "ratio of 3.00 > max_ratio=1.5" in latency.reason

    verdict, results = measure(ANALYSIS, Measures(9, 0, 0.010), stable)
    assert verdict == "INCONCLUSIVE" and "fewer than min_requests=10" in results[0].reason

    verdict, results = measure(ANALYSIS, Measures(20, 20, None), stable)  # every request failed: no latency
    assert verdict == "FAILED" and results[1].verdict == "INCONCLUSIVE"
