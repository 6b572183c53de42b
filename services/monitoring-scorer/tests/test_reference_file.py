"""The reference set producers write (the contract's ``reference_npz``) is what the scorer loads, and the
bad-input bound they write (``bad_input_over``) is above what clean traffic shows, however many columns."""

import numpy as np
import pytest

from opml_monitoring_scorer.core.scorer import load_reference
from opml_monitoring_scorer_contract.reference import BAD_ROWS_OVER, bad_input_over, clean_bad_share, reference_npz


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


WINDOW = 1_000


@pytest.mark.parametrize(("columns", "reference_rows"), [(2, 400), (30, 1000), (256, 1000), (256, 10_000)])
def test_clean_traffic_stays_under_the_bad_input_bound(columns: int, reference_rows: int) -> None:
    """Clean windows drawn like the reference, flagged as the scorer's range check flags them (a row
    with any column outside the reference's min..max): every window's share is under the bound."""
    rng = np.random.default_rng(columns + reference_rows)
    reference = rng.normal(size=(reference_rows, columns))
    low, high = reference.min(axis=0), reference.max(axis=0)
    bound = bad_input_over(columns, reference_rows, WINDOW)
    assert bound is not None and bound >= BAD_ROWS_OVER
    shares = [float(((w < low) | (w > high)).any(axis=1).mean())
              for w in (rng.normal(size=(WINDOW, columns)) for _ in range(40))]
    assert max(shares) < bound, (max(shares), bound)
    assert abs(np.mean(shares) - clean_bad_share(columns, reference_rows)) < 0.05
    if columns == 256 and reference_rows == 1000:
        assert min(shares) > 0.3, "the fixed 5 % bound alerted on every clean window of such a model"
    broken = rng.normal(size=(WINDOW, columns))
    broken[: int(WINDOW * min(1.0, bound + 0.05)), 0] = np.nan  # NaN in a column of most rows
    assert float((np.isnan(broken) | (broken < low) | (broken > high)).any(axis=1).mean()) > bound


def test_no_bad_input_rule_where_the_range_check_cannot_tell() -> None:
    assert bad_input_over(4096, 100, WINDOW) is None
