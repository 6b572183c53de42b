"""Performance models and their transfer, on environments with a known latency law (pure logic;
the measured onnxruntime case is bench/perfmodel_transfer.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from opml_common.errors import FailedPrecondition, InvalidArgument
from opml_common.perfmodel import (
    FromScratch,
    Influence,
    InfluenceTransfer,
    ModelShift,
    PerformanceModel,
    Sample,
    ScaleShift,
    ServingConfig,
    grid,
    influential_terms,
    mape,
)

CONFIGS = list(grid(batches=(1, 2, 4, 8, 16, 32), threads=(1, 2, 4)))
SIZES = (0.1, 1.0, 10.0)


def law(config: ServingConfig, mflop: float, *, scale: float = 1.0, batch_exponent: float = 0.8) -> float:
    """Latency in ms: work grows with batch and size, threads help fp32 more than int8, int8 is cheaper,
    disabled graph optimization costs 30%, parallel mode costs a little."""
    int8 = config.precision == "int8"
    speedup = config.threads ** (0.2 if int8 else 0.7)
    ms = 0.05 * mflop * config.batch ** batch_exponent / speedup * (0.4 if int8 else 1.0)
    ms *= 1.3 if config.opt_level == "disable" else 1.0
    ms *= 1.05 if config.execution_mode == "parallel" else 1.0
    return scale * ms


def environment(**law_args) -> list[Sample]:
    return [Sample(f"m{size}", size, config, law(config, size, **law_args)) for size in SIZES for config in CONFIGS]


def split(samples: list[Sample], n: int, seed: int = 0) -> tuple[list[Sample], list[Sample]]:
    chosen = set(np.random.default_rng(seed).choice(len(samples), size=n, replace=False).tolist())
    return ([s for i, s in enumerate(samples) if i in chosen], [s for i, s in enumerate(samples) if i not in chosen])


def error(model, samples: list[Sample]) -> float:
    return mape(model.predict_ms(samples), np.array([s.latency_ms for s in samples]))


def test_the_source_model_predicts_unseen_configurations_of_its_environment():
    train, test = split(environment(), 300)
    model = PerformanceModel(environment="src").fit(train)
    assert error(model, test) < 10.0
    throughput = model.predict_rps(test[:1])[0]
    assert throughput == pytest.approx(test[0].config.batch * 1000 / model.predict_ms(test[:1])[0])


def test_influential_terms_name_the_planted_options_and_the_threads_precision_interaction():
    terms = influential_terms(environment(), top=6)
    names = [t.term for t in terms]
    assert names[0] in ("batch", "model_size")
    assert {"batch", "model_size", "int8"} <= set(names)
    assert "threads x int8" in names  # threads help fp32 more than int8
    assert next(t for t in terms if t.term == "threads x int8").weight > 0


def test_option_importances_rank_batch_and_size_above_the_execution_mode():
    importances = PerformanceModel(environment="src").fit(environment()).option_importances()
    assert math.isclose(sum(importances.values()), 1.0)
    assert importances["batch"] > importances["parallel"] and importances["model_size"] > importances["parallel"]


@pytest.mark.parametrize("n", [5, 10])
def test_transfer_from_a_shifted_environment_beats_learning_from_scratch(n):
    source_samples = environment()
    target = environment(scale=2.5, batch_exponent=0.9)  # slower, and batches cost more there
    source = PerformanceModel(environment="src").fit(source_samples)
    terms = influential_terms(source_samples, top=6)
    train, test = split(target, n, seed=1)
    scratch = min(error(FromScratch("trees").fit(train), test), error(FromScratch("linear").fit(train), test))
    for learner in (ModelShift(source), ScaleShift(source), InfluenceTransfer(source, terms)):
        assert error(learner.fit(train), test) < scratch / 2


def test_the_scale_shift_keeps_to_the_median_ratio_when_a_sample_is_an_outlier():
    source_samples = environment()
    source = PerformanceModel(environment="src").fit(source_samples)
    target = environment(scale=2.0)
    train, test = split(target, 5, seed=2)
    train[0] = Sample(train[0].model, train[0].mflop_per_row, train[0].config, train[0].latency_ms * 20)  # a stall
    assert error(ScaleShift(source).fit(train), test) < 10.0
    assert error(ScaleShift(source).fit(train), test) < error(ModelShift(source).fit(train), test)


def test_bad_inputs_are_refused_by_name():
    with pytest.raises(InvalidArgument, match="batch"):
        ServingConfig(0)
    with pytest.raises(InvalidArgument, match="opt_level"):
        ServingConfig(1, opt_level="max")
    with pytest.raises(InvalidArgument, match="at least 2"):
        PerformanceModel(environment="src").fit(environment()[:1])
    with pytest.raises(FailedPrecondition, match="not fitted"):
        PerformanceModel(environment="src").predict_ms(environment()[:1])
    with pytest.raises(InvalidArgument, match="latency"):
        PerformanceModel(environment="src").fit([Sample("m", 1.0, ServingConfig(1)), Sample("m", 1.0, ServingConfig(2))])
    source = PerformanceModel(environment="src").fit(environment())
    with pytest.raises(InvalidArgument, match="terms"):
        InfluenceTransfer(source, [Influence("colour", 1.0)])
    with pytest.raises(InvalidArgument, match="at least 2"):
        ModelShift(source).fit(environment()[:1])
    with pytest.raises(FailedPrecondition, match="not fitted"):
        FromScratch().predict_ms(environment()[:1])
    with pytest.raises(InvalidArgument, match="learner"):
        FromScratch("svm")


def test_an_option_constant_in_the_environment_is_left_out_of_the_terms():
    int8_only = [s for s in environment() if s.config.precision == "int8"]
    names = [t.term for t in influential_terms(int8_only, top=10)]
    assert names and not any("int8" in name for name in names)
