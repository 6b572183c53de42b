"""The most influential options and pairwise interactions of an environment, named.

The paper's finding is that what transfers best is *which* options and interactions matter. A
sparse linear model (Lasso) over standardized main effects and pairwise products, on log latency,
keeps few terms and gives each a weight in the same unit (log latency per standard deviation),
so "batch" and "threads x int8" can be ranked against each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sklearn.linear_model import LassoCV
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import PolynomialFeatures, StandardScaler

from opml_common.errors import InvalidArgument
from opml_common.perfmodel.space import OPTIONS, Sample, encode, log_latency


@dataclass(frozen=True)
class Influence:
    """A term (an option, or two joined by ``x``) and its signed weight on log latency."""

    term: str
    weight: float


def interaction_features() -> PolynomialFeatures:
    """Main effects and pairwise products of the option columns."""
    return PolynomialFeatures(degree=2, interaction_only=True, include_bias=False)


def term_names(features: PolynomialFeatures, options: Sequence[str] = OPTIONS) -> list[str]:
    return [name.replace(" ", " x ") for name in features.get_feature_names_out(list(options))]


def influential_terms(samples: Sequence[Sample], *, top: int = 8, seed: int = 0) -> list[Influence]:
    """The ``top`` terms with the largest absolute Lasso weight (zero-weight terms left out).

    Raises:
        InvalidArgument: fewer than 10 samples (the Lasso's cross-validation needs them), or ``top`` < 1.
    """
    if len(samples) < 10:
        raise InvalidArgument("samples", f"need at least 10 measurements to rank terms, but got {len(samples)}")
    if top < 1:
        raise InvalidArgument("top", f"must be >= 1, but got {top}")
    matrix = encode(samples)
    # An option constant here (int8 on an int8-only kind) would only copy other terms into its products.
    varying = [column for column in range(matrix.shape[1]) if np.ptp(matrix[:, column]) > 0]
    features = interaction_features()
    model = make_pipeline(features, StandardScaler(), LassoCV(cv=5, random_state=seed, max_iter=20000))
    model.fit(matrix[:, varying], log_latency(samples))
    weights = model[-1].coef_
    names = term_names(features, [OPTIONS[column] for column in varying])
    ranked = sorted(zip(names, weights, strict=True), key=lambda p: -abs(p[1]))
    return [Influence(name, float(weight)) for name, weight in ranked[:top] if not np.isclose(weight, 0.0)]
