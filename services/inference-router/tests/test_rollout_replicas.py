"""A rollout's state is written only under the leader lease's fence (a deposed leader's late write is
refused; real Redis), and an analysis's quality checks that wait for the scorer's windows. The
leader's analysis judging a follower's requests and mirror: test_router_replicas.py."""

from __future__ import annotations

import pytest

from opml_common.lease import LeaderLease, NotLeader
from opml_common.storage import redis_client
from opml_inference_router.control.analysis import FAILED, INCONCLUSIVE, PASSED, CheckResult
from opml_inference_router.control.progressive import ProgressiveRollouts, RolloutState, RolloutStore
from opml_inference_router_contract.rollout_spec import RolloutSpec


async def test_a_deposed_leaders_rollout_write_is_refused(platform_settings) -> None:
    redis = redis_client(platform_settings)
    prefix = platform_settings.redis_prefix
    key = f"{prefix}lease:inference-router"
    old = LeaderLease(redis, "inference-router", "old", prefix=prefix, ttl_s=30)
    new = LeaderLease(redis, "inference-router", "new", prefix=prefix, ttl_s=30)
    state = RolloutState("m", 2, 1, RolloutSpec.from_dict({"steps": [{"weight": 50}, {"analysis": {
        "interval_s": 1.0, "checks": {"error_rate": {"max_increase": 0.01}}}}]}))
    try:
        async with old:
            await old.wait_leading()
            old_store = RolloutStore(redis, prefix=prefix, fence=lambda: old.fence)
            await old_store.save(state)
            await redis.delete(key)  # as if its lease expired while it stalled
            async with new:
                await new.wait_leading()
                assert old.leading  # its own clock has not run out
                state.step = 1
                with pytest.raises(NotLeader, match="moved on"):
                    await old_store.save(state)
                (stored,) = await RolloutStore(redis, prefix=prefix).load()
                assert stored.step == 0  # not the deposed leader's late write
                await RolloutStore(redis, prefix=prefix, fence=lambda: new.fence).save(state)
                (stored,) = await RolloutStore(redis, prefix=prefix).load()
                assert stored.step == 1
    finally:
        await redis.aclose()


def _result(check: str, verdict: str, reason: str = "") -> CheckResult:
    return CheckResult(check, verdict, 0.0, 0.0, 0.0, 0, 0, reason)


def test_a_quality_check_waiting_for_the_scorer_neither_pauses_the_analysis_nor_lets_it_pass() -> None:
    spec = RolloutSpec.from_dict({"steps": [{"weight": 50}, {"analysis": {"interval_s": 1.0, "count": 3, "checks": {
        "error_rate": {"max_increase": 0.01}, "accuracy": {"max_drop": 0.05}}}}]})
    analysis = spec.steps[1].analysis
    state = RolloutState("m", 2, 1, spec, step=1)
    waiting = _result("accuracy", INCONCLUSIVE, "too little evidence from the monitoring-scorer: 0 labels")  # 0 < 50
    judge = ProgressiveRollouts._without_waiting
    assert judge(state, analysis, [_result("error_rate", PASSED), waiting]) == PASSED
    assert judge(state, analysis, [_result("error_rate", FAILED), waiting]) == FAILED
    state.measurements = 2  # both passed: this one would complete the analysis, and the scorer has not spoken
    assert judge(state, analysis, [_result("error_rate", PASSED), waiting]) == INCONCLUSIVE
    assert judge(state, analysis, [_result("error_rate", PASSED), _result("accuracy", PASSED)]) == PASSED
    unconfirmed = CheckResult("accuracy", INCONCLUSIVE, 0.7, 0.9, 0.05, 100, 100,
                              "true accuracy 0.7 ...; not confirmed: the scorer could not be read")
    state.measurements = 0
    assert judge(state, analysis, [_result("error_rate", PASSED), unconfirmed]) == INCONCLUSIVE
