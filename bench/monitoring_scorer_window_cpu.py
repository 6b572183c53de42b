"""CPU of one window's score, per segment and for the version, on the main job's inspection data: the
story's MLP as ``bench/monitoring_scorer_segments.py`` trains it, a reference of ``--rows`` rows a line (as
the evaluate step writes it), and per line ``--windows`` successive clean windows of 1,000 patches, then
line 3 under dimmed lamps, each scored by the line's own monitor and by the version's (all lines' rows).
The scorer falls behind the story's traffic (~400 rows/s) when a window costs more than its rows' share.

    .venv/bin/python -W ignore bench/monitoring_scorer_window_cpu.py
    # the same against another revision's scorer:
    git archive <rev> services/monitoring-scorer/src | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base/services/monitoring-scorer/src .venv/bin/python -W ignore bench/monitoring_scorer_window_cpu.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "scripts" / "story"), str(ROOT / "bench")]

import pipeline_train  # noqa: E402
from inspection_data import FEATURES, LINES, inspection_patches, span_features  # noqa: E402
from monitoring_scorer_segments import TRAFFIC_SEED, span  # noqa: E402

from opml_monitoring_scorer.core.config import MonitoringConfig  # noqa: E402
from opml_monitoring_scorer.core.decode import Batch  # noqa: E402
from opml_monitoring_scorer.core.monitor import ModelMonitor  # noqa: E402
from opml_monitoring_scorer.core.reference import Outputs, ReferenceSet, Task  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=int, default=2)
    parser.add_argument("--rows", type=int, default=500, help="reference rows a line")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--windows", type=int, default=4, help="successive windows of 1,000 rows a line")
    parser.add_argument("--dimmed", type=float, default=0.6, help="line 3's lamps in the drifted windows")
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
    monitors = {"version": ModelMonitor(whole, config)}
    for line in LINES:
        monitors[str(line)] = ModelMonitor(whole.segment("line", str(line)), config,
                                           quality=monitors["version"].quality)
    print(f"load average {os.getloadavg()[0]:.1f}; CPU s of each successive window's score")
    for line, lighting in [*((line, 1.0) for line in LINES), (3, args.dimmed)]:
        batches = []
        for k in range(args.windows):
            images, _ = inspection_patches(1000, TRAFFIC_SEED + 10 * k + line, line=line, lighting=lighting)
            wx = span_features(images).astype(np.float32)
            ws = scores(wx)
            batches.append(Batch({n: wx[:, i].astype(np.float64) for i, n in enumerate(FEATURES)},
                                 Outputs(ws.argmax(axis=1).astype(np.float64), ws.astype(np.float64)),
                                 [""] * len(wx)))
        for name in (str(line), "version"):
            cpu = []
            for batch in batches:
                started = time.process_time()
                monitors[name].score(batch, index=0, first_time=0.0, last_time=1.0)
                cpu.append(time.process_time() - started)
            print(f"line {line} lamps {lighting:g}  {'segment' if name != 'version' else 'version':<8} "
                  + " ".join(f"{c:.3f}" for c in cpu), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
