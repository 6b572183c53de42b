"""``opml monitor status``'s text for a version with and without reference rows."""

from __future__ import annotations

from opml.monitoring.v1 import monitoring_pb2 as pb

from opml_monitoring_scorer.cli import status_lines


def test_a_version_without_reference_rows_says_so() -> None:
    auto = pb.ModelStatus(name="models/m/versions/1", reference=pb.BundleRef(context="plant-a", bundle="b1"),
                          limitations=["the bundle has no reference.npz"])
    assert status_lines(auto) == ["models/m/versions/1: task unknown, reference plant-a/b1 (no reference rows)",
                                  "windows 0, predictions 0, firing: none", "note: the bundle has no reference.npz"]
    full = pb.ModelStatus(name="models/m/versions/2", task="binary", reference_rows=500, reference_performance=0.9,
                          reference=pb.BundleRef(context="plant-a", bundle="b2"), windows=3, predictions=900,
                          firing=["drift"])
    assert status_lines(full)[:2] == ["models/m/versions/2: binary, reference plant-a/b2 (500 rows, performance 0.900)",
                                      "windows 3, predictions 900, firing: drift"]
