"""The reference set producers write (the contract's ``reference_npz``) is what the scorer loads."""

import numpy as np
import pytest

from opml_monitoring_scorer.core.scorer import load_reference
from opml_monitoring_scorer_contract.reference import reference_npz


def test_a_written_reference_set_loads_with_its_columns_outputs_and_labels():
    rng = np.random.default_rng(3)
    rows = 300
    scores = rng.dirichlet(np.ones(3), size=rows).astype(np.float32)
    data = reference_npz({"age": rng.normal(40, 5, rows), "line": np.array(["a", "b"] * (rows // 2), dtype=object)},
                         predicted=scores.argmax(axis=1), scores=scores, labels=rng.integers(0, 3, rows))

    reference = load_reference(data, task=None)

    assert set(reference.features) == {"age", "line"}
    assert reference.labels is not None and len(reference.labels) == rows
    np.testing.assert_array_equal(reference.outputs.predicted, scores.argmax(axis=1))


def test_every_wrong_column_is_named_at_once():
    with pytest.raises(ValueError) as error:
        reference_npz({"age": np.zeros(5), "wide": np.zeros((10, 2))}, predicted=np.zeros(10), labels=np.zeros(4))

    message = str(error.value)
    assert "feature.age: 5 rows" in message and "feature.wide: shape (10, 2)" in message
    assert "labels: 4 rows" in message


def test_no_feature_is_refused():
    with pytest.raises(ValueError, match="features: none given"):
        reference_npz({}, predicted=np.zeros(3))
