"""Statistics of a span and the schema inferred from them: counts, shares, quantiles, histograms on
fixed edges, capped frequencies, and the documents' validation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from opml_job_orchestrator.pipelines import schema, statistics
from opml_job_orchestrator.pipelines.schema import SchemaError
from opml_job_orchestrator.pipelines.statistics import StatisticsError, compute, histogram
from opml_job_orchestrator.pipelines.table import from_rows, read_csv_text


def _span(rows: int = 100, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    lines = ["x,k,color,user,flag"]
    for i in range(rows):
        lines.append(f"{rng.normal():.6f},{i % 3},{['red', 'green', 'blue'][i % 3]},u{i},{'true' if i % 2 else 'false'}")
    return "\n".join(lines) + "\n"


def test_counts_shares_and_numeric_summaries() -> None:
    stats = compute(read_csv_text("x,s\n1,a\n,b\nnan,\n3,a\ninf,a\n"))
    x, s = stats["features"]["x"], stats["features"]["s"]
    assert stats["num_examples"] == 5
    assert (x["type"], x["count"], x["missing"], x["nan"], x["nan_share"]) == ("float", 4, 1, 1, 0.2)
    numeric = x["numeric"]
    assert (numeric["min"], numeric["max"], numeric["mean"], numeric["infinite"]) == (1.0, 3.0, 2.0, 1)
    assert dict(map(tuple, numeric["quantiles"]))[0.5] == 2.0
    assert numeric["histogram"]["above"] == 1, "an infinity lands past the last edge, not in a bin"
    assert s["categorical"] == {"unique": 2, "top": [["a", 3], ["b", 1]], "other": 0}
    json.dumps(stats, allow_nan=False)  # strict JSON


def test_histograms_use_the_schema_edges_so_spans_compare_bin_for_bin() -> None:
    first = compute(read_csv_text(_span(seed=0)))
    inferred = schema.infer(first, span="s1")
    second = compute(read_csv_text(_span(seed=1)), inferred)
    edges = inferred["features"]["x"]["bins"]
    assert first["features"]["x"]["numeric"]["histogram"]["edges"] == edges
    assert second["features"]["x"]["numeric"]["histogram"]["edges"] == edges
    assert sum(first["features"]["x"]["numeric"]["histogram"]["counts"]) == 100
    # a column with few values gets a bin per value, not merged deciles
    assert inferred["features"]["k"]["bins"] == [-0.5, 0.5, 1.5, 2.5]
    assert first["features"]["k"]["numeric"]["histogram"]["counts"] == [34, 33, 33]


def test_histogram_counts_below_and_above_the_edges() -> None:
    values = np.array([-5.0, 0.0, 0.5, 1.0, 2.0, np.nan, np.inf])
    assert histogram(values, [0.0, 0.5, 1.0]) == {"edges": [0.0, 0.5, 1.0], "counts": [1, 2], "below": 1, "above": 2}


def test_categorical_frequencies_are_capped_with_an_other_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(statistics, "MAX_TOP_VALUES", 2)
    stats = compute(from_rows(["c"], [["a"], ["a"], ["a"], ["b"], ["b"], ["c"], ["d"]]))
    assert stats["features"]["c"]["categorical"] == {"unique": 4, "top": [["a", 3], ["b", 2]], "other": 2}


def test_a_string_column_in_the_schema_stays_categorical_when_a_span_holds_digits() -> None:
    zips = {"format": 1, "features": {"zip": {"type": "string", "required": True}}}
    assert statistics.text_columns(zips) == {"zip"}
    stats = compute(read_csv_text("zip\n01099\n01099\n80331\n", keep_text={"zip"}), zips)
    assert stats["features"]["zip"]["type"] == "int"
    assert stats["features"]["zip"]["categorical"]["top"] == [["01099", 2], ["80331", 1]], "leading zeros kept"
    with pytest.raises(ValueError, match="keep_text"):
        compute(read_csv_text("zip\n01099\n"), zips)


def test_schema_inference_required_domains_ranges() -> None:
    text = _span() + ",,,,\n"  # one row with every value missing
    inferred = schema.infer(compute(read_csv_text(text)), span="s1")
    features = inferred["features"]
    assert inferred["inferred_from"] == "s1"
    assert features["color"]["domain"] == ["blue", "green", "red"]
    assert "domain" not in features["user"], "an identifier (every value distinct) is no domain"
    assert features["x"]["required"] is False
    assert features["flag"]["type"] == "bool"
    assert features["x"]["range"]["min"] < 0 < features["x"]["range"]["max"]
    assert schema.check(json.loads(json.dumps(inferred))) == inferred
    solid = schema.infer(compute(read_csv_text(_span())), span="s1")["features"]
    assert solid["x"]["required"] is True


def test_schema_check_names_every_wrong_field() -> None:
    bad = {"format": 2, "features": {"a": {"type": "text", "bins": [1, 1]}, "b": {"type": "int", "range": {"min": 2,
                                                                                                          "max": 1},
                                                                                   "extra": 1}}}
    with pytest.raises(SchemaError) as caught:
        schema.check(bad)
    message = str(caught.value)
    for part in ("format: must be 1", "features.a.type: must be one of", "features.a.bins: only numeric",
                 "features.b.range: must be", "features.b.extra: is not a field"):
        assert part in message


def test_statistics_read_back_are_checked() -> None:
    good = compute(read_csv_text("x\n1\n2\n"))
    assert statistics.check(json.loads(json.dumps(good)), "s") == good
    broken = json.loads(json.dumps(good))
    broken["features"]["x"]["numeric"]["histogram"]["counts"] = [1]
    broken["features"]["x"]["count"] = -1
    with pytest.raises(StatisticsError, match=r"features.x.count must be a count.*histogram must hold"):
        statistics.check(broken, "s")
    broken = json.loads(json.dumps(good))
    del broken["features"]["x"]["nan_share"]
    broken["features"]["x"]["numeric"]["quantiles"] = [[0.5]]
    broken["features"]["x"]["numeric"]["max"] = "big"
    with pytest.raises(StatisticsError, match=r"nan_share must be a number.*min, max, mean and std.*quantiles must"):
        statistics.check(broken, "s")
    with pytest.raises(StatisticsError, match="format must be 1"):
        statistics.check({"format": 0, "num_examples": 1, "features": {}}, "s")


def test_long_values_go_to_other_so_statistics_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(statistics, "MAX_TOP_CHARS", 10)
    stats = compute(from_rows(["c"], [["aaaa"], ["aaaa"], ["bbbbbb"], ["cccccccc"]]))
    assert stats["features"]["c"]["categorical"] == {"unique": 3, "top": [["aaaa", 2], ["bbbbbb", 1]], "other": 1}
