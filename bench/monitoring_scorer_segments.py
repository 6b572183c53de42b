"""Each line against its own reference rows, on the main job's inspection data: the story's MLP trained
as its pipeline trains it (``scripts/story/pipeline_train.py``), the newest span as the reference (as the
evaluate step writes it, each row's line beside it), and per line a clean window, then line 3 under
dimmed lamps. Prints, per line and window, against the whole reference and against the line's own rows:
the true accuracy, the model's mean confidence, the CBPE and MPP estimates and the largest input drift
distance (the story's input-drift rule fires over 0.3), and how long each monitor took to fit.

    .venv/bin/python -W ignore bench/monitoring_scorer_segments.py                  # quick scale (2 days, 250 rows)
    .venv/bin/python -W ignore bench/monitoring_scorer_segments.py --days 3 --rows 500 --epochs 25   # full
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "scripts" / "story")]

import pipeline_train  # noqa: E402
from inspection_data import FEATURES, LINES, inspection_patches, span_features  # noqa: E402

from opml_monitoring_scorer.core.config import MonitoringConfig  # noqa: E402
from opml_monitoring_scorer.core.decode import Batch  # noqa: E402
from opml_monitoring_scorer.core.monitor import ModelMonitor  # noqa: E402
from opml_monitoring_scorer.core.reference import Outputs, ReferenceSet, Task  # noqa: E402

TRAFFIC_SEED = 1_002_000


def span(day: int, line: int, rows: int, lighting: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    images, labels = inspection_patches(rows, day, line=line, lighting=lighting)
    return np.round(span_features(images), 3).astype(np.float32), labels  # as the span CSV holds them


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=int, default=2)
    parser.add_argument("--rows", type=int, default=250, help="rows of a line's span")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--window", type=int, default=1000, help="rows of a line's window")
    parser.add_argument("--dimmed", type=float, default=0.6, help="line 3's lamps in the drifted window")
    args = parser.parse_args()
    x, y = map(np.concatenate, zip(*[span(d, line, args.rows) for d in range(args.days) for line in LINES]))
    rng = np.random.default_rng(0)
    weights = pipeline_train.train(x, y, pipeline_train.start_weights(x.shape[1], 64, rng), args.epochs, rng)

    def scores(rows: np.ndarray) -> np.ndarray:
        logits = np.maximum(rows @ weights["W1"] + weights["B1"], 0) @ weights["W2"] + weights["B2"]
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    parts = [span(args.days - 1, line, args.rows) for line in LINES]
    rx, ry = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    rs = scores(rx)
    whole = ReferenceSet.build(task=Task.MULTICLASS, features={n: rx[:, i] for i, n in enumerate(FEATURES)},
                               predicted=rs.argmax(axis=1), scores=rs, labels=ry,
                               segments={"line": np.repeat([str(line) for line in LINES], args.rows)})
    config = MonitoringConfig()
    started = time.perf_counter()
    monitors = {"whole": ModelMonitor(whole, config)}
    print(f"whole reference: {len(whole)} rows, accuracy {whole.performance():.3f}, fitted in "
          f"{time.perf_counter() - started:.1f} s")
    for line in LINES:
        started = time.perf_counter()
        monitors[str(line)] = ModelMonitor(whole.segment("line", str(line)), config, quality=monitors["whole"].quality)
        print(f"line {line} reference: {args.rows} rows, accuracy {monitors[str(line)].reference_performance:.3f}, "
              f"fitted in {time.perf_counter() - started:.1f} s")
    print(f"{'window':<22} {'judged by':<9} {'true':>6} {'conf':>6} {'CBPE':>6} {'MPP':>6} {'drift max':>9}")
    for line, lighting in [*((line, 1.0) for line in LINES), (3, args.dimmed)]:
        images, labels = inspection_patches(args.window, TRAFFIC_SEED + line, line=line, lighting=lighting)
        wx = span_features(images).astype(np.float32)
        ws = scores(wx)
        batch = Batch({n: wx[:, i].astype(np.float64) for i, n in enumerate(FEATURES)},
                      Outputs(ws.argmax(axis=1).astype(np.float64), ws.astype(np.float64)), [""] * len(labels))
        for name in ("whole", str(line)):
            score = monitors[name].score(batch, index=0, first_time=0.0, last_time=1.0)
            print(f"{f'line {line} lamps {lighting:g}':<22} {'all' if name == 'whole' else 'own':<9} "
                  f"{np.mean(ws.argmax(axis=1) == labels):>6.3f} {ws.max(axis=1).mean():>6.3f} {score.cbpe:>6.3f} "
                  f"{score.mpp:>6.3f} {max(d.distance for d in score.drift.values()):>9.3f}", flush=True)


if __name__ == "__main__":
    main()
