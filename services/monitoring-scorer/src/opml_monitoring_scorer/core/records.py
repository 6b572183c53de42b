"""Plain records of what the scorer keeps: a window's score and an alert, as JSON-able dicts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from opml_monitoring_scorer.core.drift import FeatureDrift
from opml_monitoring_scorer.core.monitor import WindowScore


def _drift(d: FeatureDrift | None) -> dict[str, Any] | None:
    return None if d is None else asdict(d)


def window_record(score: WindowScore, *, segment: str = "") -> dict[str, Any]:
    """What the history keeps of a window (everything the API shows); ``segment``: "" for the version's."""
    return {"index": score.index, "segment": segment, "rows": score.rows, "first_time": score.first_time, "last_time": score.last_time,
            "score": score.score, "parts": score.parts, "mpp": score.mpp, "mpp_labels": score.mpp_labels,
            "cbpe": score.cbpe, "true": score.true,
            "labelled": score.labelled, "drift": [asdict(d) for d in score.drift.values()],
            "output_drift": _drift(score.output_drift), "confidence_drift": _drift(score.confidence_drift),
            "data_quality_share": score.data_quality.bad_rows_share, "flags": score.flags}


@dataclass
class AlertRecord:
    model: str
    version: str
    rule: str
    signal: str
    raised_at_window: int
    value: float | None
    features: dict[str, float] = field(default_factory=dict)
    resolved_at_window: int | None = None
    segment: str = ""
    """The segment whose windows raised it ("": the version as a whole; records saved before segments have none)."""

    @property
    def firing(self) -> bool:
        return self.resolved_at_window is None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AlertRecord:
        return cls(**data)
