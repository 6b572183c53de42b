"""A rollout's measurement: the router's per-version window, the shadow comparisons, the scorer's windows,
and the checks that judge them."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from opml.monitoring.v1 import quality_events_pb2

from opml_common.errors import InvalidArgument
from opml_inference_router.control.analysis import measure
from opml_inference_router.control.quality import Quality, QualityBook
from opml_inference_router.routing.shadow import ShadowMeasures
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


def _measures(latencies, errors: int = 0) -> Measures:
    window = OutcomeWindow()
    for seconds in latencies:
        window.answered(float(seconds))
    for _ in range(errors):
        window.failed("INTERNAL")
    return window.take()


def test_a_measurement_passes_fails_or_is_inconclusive_with_its_evidence():
    rng = np.random.default_rng(1)
    stable = _measures(rng.lognormal(np.log(0.010), 0.2, 990), errors=10)
    verdict, results = measure(ANALYSIS, _measures(rng.lognormal(np.log(0.011), 0.2, 990), errors=10), stable)
    assert verdict == "PASSED" and [r.verdict for r in results] == ["PASSED", "PASSED"]

    verdict, results = measure(ANALYSIS, _measures(rng.lognormal(np.log(0.030), 0.2, 950), errors=50), stable)
    assert verdict == "FAILED"
    error_rate, latency = results
    assert (error_rate.new_value, error_rate.stable_value, error_rate.bound) == (0.05, 0.01, 0.01)
    assert "not chance" in error_rate.reason
    assert latency.verdict == "FAILED" and latency.new_value / latency.stable_value == pytest.approx(3.0, rel=0.15)
    assert "> max_ratio=1.5" in latency.reason and "slower overall" in latency.reason

    stable = Measures(requests=100, errors=1, p99_s=0.010)
    verdict, results = measure(ANALYSIS, Measures(9, 0, 0.010), stable)
    assert verdict == "INCONCLUSIVE" and "fewer than min_requests=10" in results[0].reason

    verdict, results = measure(ANALYSIS, Measures(20, 20, None), stable)  # every request failed: no latency
    assert verdict == "FAILED" and results[1].verdict == "INCONCLUSIVE"


def test_disagreement_passes_fails_or_is_inconclusive_on_the_mirrored_comparisons():
    analysis = Analysis(interval_s=1, checks=(Check("disagreement", 0.05, min_requests=20),))
    idle = Measures(0, 0, None)
    verdict, (result,) = measure(analysis, idle, idle, shadow=ShadowMeasures(mirrored=30, compared=30, rows=60,
                                                                             disagreed_rows=2))
    assert verdict == "PASSED" and result.new_value == pytest.approx(2 / 60) and result.new_requests == 30
    verdict, (result,) = measure(analysis, idle, idle, shadow=ShadowMeasures(mirrored=40, compared=40, rows=40,
                                                                             disagreed_rows=8))
    assert verdict == "FAILED" and "a share of 0.2000 > max_share=0.05" in result.reason
    verdict, (result,) = measure(analysis, idle, idle, shadow=ShadowMeasures(mirrored=25, shed=6, compared=19,
                                                                             rows=19))
    assert verdict == "INCONCLUSIVE" and "19 (of 25 mirrored, 6 shed, 0 failed)" in result.reason
    verdict, _ = measure(analysis, idle, idle)  # no mirror at all
    assert verdict == "INCONCLUSIVE"


def test_the_scorers_quality_checks_need_their_minimum_and_compare_in_the_tasks_direction():
    analysis = Analysis(interval_s=1, checks=(Check("estimated_accuracy", 0.02, min_requests=100),
                                              Check("accuracy", 0.02, min_requests=10)))
    idle = Measures(0, 0, None)
    stable = Quality(predictions=500, estimate=0.90, labels=400, accuracy=0.91)
    verdict, (estimated, true) = measure(analysis, idle, idle, stable_quality=stable,
                                         new_quality=Quality(predictions=300, estimate=0.89, labels=300, accuracy=0.80))
    assert verdict == "FAILED" and estimated.verdict == "PASSED" and true.verdict == "FAILED"
    assert (true.new_value, true.stable_value, true.new_requests, true.stable_requests) == (0.80, 0.91, 300, 400)
    assert "worse by 0.1100 > max_drop=0.02, and not chance" in true.reason
    # the same drop on 20 and 40 labels: 4 wrong answers against 3.6 is what chance gives
    verdict, (_, true) = measure(analysis, idle, idle, stable_quality=Quality(500, 0.90, labels=40, accuracy=0.91),
                                 new_quality=Quality(predictions=300, estimate=0.89, labels=20, accuracy=0.80))
    assert verdict == "PASSED" and "but within chance at these counts" in true.reason
    verdict, (estimated, true) = measure(analysis, idle, idle, stable_quality=stable,
                                         new_quality=Quality(predictions=99, estimate=0.95, labels=9, accuracy=0.95))
    assert verdict == "INCONCLUSIVE" and "min_predictions=100" in estimated.reason and "min_labels=10" in true.reason
    # a regressor's values are MAE: higher is worse
    mae = Analysis(interval_s=1, checks=(Check("accuracy", 0.5, min_requests=10),))
    verdict, (result,) = measure(mae, idle, idle, stable_quality=Quality(labels=50, accuracy=2.0, higher_is_better=False),
                                 new_quality=Quality(labels=50, accuracy=2.7, higher_is_better=False))
    assert verdict == "FAILED" and "true MAE 2.7000 against 2.0000" in result.reason


def test_the_quality_book_keeps_each_window_with_the_most_labels_and_pools_by_rows():
    book = QualityBook()

    def scored(window: int, rows: int, estimate: float, labelled: int = 0, truth: float | None = None,
               last: float = 100.0, version: str = "2") -> quality_events_pb2.WindowScored:
        event = quality_events_pb2.WindowScored(model="m", version=version, window=window, rows=rows,
                                                task="multiclass", estimate=estimate, estimator="cbpe",
                                                labelled=labelled)
        event.last_time.FromNanoseconds(int(last * 1e9))
        if truth is not None:
            event.true_value = truth
        return event

    async def run() -> None:
        assert await book.record(scored(0, 100, 0.9))
        assert await book.record(scored(1, 300, 0.8))
        assert await book.record(scored(1, 300, 0.8, labelled=30, truth=0.7))  # labels joined the window
        assert not await book.record(scored(1, 300, 0.8, labelled=10, truth=0.6))  # an older event of it
        assert await book.record(scored(2, 50, 0.1, last=10.0))  # before the analysis began
        quality = await book.since("m", 2, 50.0)
        assert (quality.predictions, quality.labels, quality.windows) == (400, 30, 2)
        assert quality.estimate == pytest.approx((0.9 * 100 + 0.8 * 300) / 400) and quality.accuracy == 0.7
        assert (await book.since("m", 1, 0.0)).windows == 0
        with pytest.raises(InvalidArgument):
            await book.record(quality_events_pb2.WindowScored(window=1, rows=3))
        with pytest.raises(InvalidArgument):
            await book.record(quality_events_pb2.WindowScored(model="m" * 257, version="2", window=1, rows=3))
        with pytest.raises(InvalidArgument):
            await book.record(quality_events_pb2.WindowScored(model="m", version="2", window=1, rows=-3))

    asyncio.run(run())


def _loaded_host_latencies(rng, count: int, *, median_s: float = 0.004) -> np.ndarray:
    """Latencies as a loaded 2-core host gives them: lognormal, and now and then a stall of 5-50x."""
    latencies = rng.lognormal(np.log(median_s), 0.35, count)
    stalls = rng.random(count) < 0.01
    latencies[stalls] *= rng.uniform(5, 50, stalls.sum())
    return latencies


def test_an_aa_rollout_is_rolled_back_in_under_one_analysis_in_a_hundred():
    """The same version on both sides, 220 requests each, 0.5% errors and host stalls on both: the
    bound alone fails about one measurement in eight; with the tests, under one in a hundred."""
    rng = np.random.default_rng(7)
    analysis = Analysis(interval_s=3, checks=(Check("error_rate", 0.01, min_requests=100),
                                              Check("p99_latency", 1.5, min_requests=100)))
    failed = 0
    for _ in range(1000):
        new = _measures(_loaded_host_latencies(rng, 220), errors=int(rng.binomial(220, 0.005)))
        stable = _measures(_loaded_host_latencies(rng, 220), errors=int(rng.binomial(220, 0.005)))
        failed += measure(analysis, new, stable)[0] == "FAILED"
    assert failed < 10, f"{failed} of 1000 A/A measurements failed"


def test_a_slower_or_failing_version_is_still_caught_at_its_first_measurement():
    """The tests take nothing from a version that is really worse: every measurement whose p99 is
    beyond the bound for a version 2x slower throughout fails (the others are the stable version's
    own stalls, hiding the difference from the bound itself), and so does one that fails 10%."""
    rng = np.random.default_rng(8)
    analysis = Analysis(interval_s=3, checks=(Check("error_rate", 0.01, min_requests=100),
                                              Check("p99_latency", 1.5, min_requests=100)))
    beyond = slow_caught = failing_caught = 0
    for _ in range(200):
        stable = _measures(_loaded_host_latencies(rng, 220), errors=int(rng.binomial(220, 0.005)))
        slower = measure(analysis, _measures(_loaded_host_latencies(rng, 220, median_s=0.008)), stable)[1][1]
        failing = _measures(_loaded_host_latencies(rng, 198), errors=22)
        beyond += slower.new_value / slower.stable_value > 1.5
        slow_caught += slower.verdict == "FAILED"
        failing_caught += measure(analysis, failing, stable)[1][0].verdict == "FAILED"
    assert slow_caught == beyond > 120 and failing_caught == 200, (beyond, slow_caught, failing_caught)


def test_a_version_slower_only_in_its_tail_is_judged_by_its_p99_once_it_rests_on_ten_answers():
    rng = np.random.default_rng(9)
    stable = _measures(rng.lognormal(np.log(0.004), 0.2, 2000))
    tail = rng.lognormal(np.log(0.004), 0.2, 2000)
    tail[:60] = 0.040  # 3% of its answers take 10x: the median does not move
    verdict, (result,) = measure(Analysis(interval_s=3, checks=(Check("p99_latency", 1.5, min_requests=100),)),
                                 _measures(tail), stable)
    assert verdict == "FAILED" and "rests on ten or more" in result.reason


def _stalled(rng, latencies: np.ndarray, share: float) -> np.ndarray:
    """A host stall over part of an interval: that share of the requests 10-30x slower."""
    latencies = latencies.copy()
    hit = rng.random(len(latencies)) < share
    latencies[hit] *= rng.uniform(10, 30, hit.sum())
    return latencies


def test_a_slower_version_is_caught_in_the_interval_a_stall_lifted_the_stable_versions_p99():
    """A stall that lifted the stable version's p99 in the first interval hid a version 2x slower
    throughout (the ratio of that interval's p99s under the bound); against the median of the stable
    version's recent intervals' p99s, it fails at once."""
    rng = np.random.default_rng(11)
    analysis = Analysis(interval_s=3, checks=(Check("p99_latency", 1.5, min_requests=100),))
    hidden = caught = 0
    for _ in range(100):
        recent = [_measures(rng.lognormal(np.log(0.004), 0.35, 220)) for _ in range(3)]
        stable = _measures(_stalled(rng, rng.lognormal(np.log(0.004), 0.35, 220), 0.03))
        slower = _measures(rng.lognormal(np.log(0.008), 0.35, 220))
        hidden += measure(analysis, slower, stable)[0] == "PASSED"
        verdict, (result,) = measure(analysis, slower, stable, stable_recent=[m.p99_s for m in recent])
        caught += verdict == "FAILED"
    assert hidden > 30 and caught == 100, (hidden, caught)
    assert "the median of the stable version's p99s in its last 3 intervals" in result.reason


def test_an_aa_rollout_against_the_recent_stable_p99_is_rolled_back_in_under_one_analysis_in_a_hundred():
    """Stalls of the host lift both versions at once (and each alone now and then): pooled with the
    stable version's recent intervals, an A/A analysis still fails under one measurement in a hundred."""
    rng = np.random.default_rng(12)
    analysis = Analysis(interval_s=3, checks=(Check("error_rate", 0.01, min_requests=100),
                                              Check("p99_latency", 1.5, min_requests=100)))
    recent: list[float] = []
    failed = 0
    for _ in range(1000):
        share = rng.choice([0.0, 0.0, 0.01, 0.03])  # this interval's stall, both versions alike
        new = _measures(_stalled(rng, _loaded_host_latencies(rng, 220), share), errors=int(rng.binomial(220, 0.005)))
        stable = _measures(_stalled(rng, _loaded_host_latencies(rng, 220), share),
                           errors=int(rng.binomial(220, 0.005)))
        failed += measure(analysis, new, stable, stable_recent=recent[-4:])[0] == "FAILED"
        recent.append(stable.p99_s)
    assert failed < 10, f"{failed} of 1000 A/A measurements failed"
