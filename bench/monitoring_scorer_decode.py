"""CPU time per event of the monitoring-scorer's one-row path in one process, stage by stage: the
one-by-one decode (decode_prediction of each event, then Batch.concat) against the batched decode
(decode_predictions of a window's events) measured in the same run, and the other in-process stages
(CloudEvent and PredictionMade parsing, window scoring). Thread CPU time (time.thread_time), so the
numbers hold on a loaded machine better than wall time; no broker, faust or Redis.

    .venv/bin/python bench/monitoring_scorer_decode.py                  # 5000 one-row events
    .venv/bin/python bench/monitoring_scorer_decode.py --rows-per-event 10
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "services" / "monitoring-scorer" / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from monitoring_scorer_stream import events as make_events  # noqa: E402
from opml.inference.v1 import events_pb2 as inference_events  # noqa: E402

from opml_common.bus.cloudevents import CloudEvent  # noqa: E402
from opml_monitoring_scorer.core.config import MonitoringConfig  # noqa: E402
from opml_monitoring_scorer.core.decode import Batch, decode_prediction, decode_predictions  # noqa: E402
from opml_monitoring_scorer.core.monitor import ModelMonitor  # noqa: E402
from opml_monitoring_scorer.core.reference import Task  # noqa: E402
from opml_monitoring_scorer.synthetic import FEATURES, SyntheticWorld  # noqa: E402


def cpu_ms_per_1000(fn, events: int) -> tuple[float, object]:
    started = time.thread_time()
    out = fn()
    return (time.thread_time() - started) * 1e6 / events, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--rows-per-event", type=int, default=1)
    parser.add_argument("--window", type=int, default=1000, help="rows per window")
    args = parser.parse_args()
    n, r = args.events, args.rows_per_event
    per_window = args.window // r
    world = SyntheticWorld(Task.BINARY, seed=0)
    messages = make_events(world, n * r, r)
    records = [(c.kafka_headers(), c.data) for c in
               (CloudEvent.from_proto(m, source="opml/bench", subject="bench/1") for m in messages)]
    config = MonitoringConfig.parse(f"features: {{x: [{', '.join(FEATURES)}]}}\n".encode(), what="monitoring.yaml")
    monitor = ModelMonitor(world.reference(3000), config)
    kw = {"task": Task.BINARY, "feature_names": config.feature_names}
    parse_ms, datas = cpu_ms_per_1000(lambda: [CloudEvent.from_kafka(h, v).data for h, v in records], n)
    proto_ms, preds = cpu_ms_per_1000(lambda: [inference_events.PredictionMade.FromString(d) for d in datas], n)
    windows = range(0, n, per_window)
    one_ms, one = cpu_ms_per_1000(lambda: [Batch.concat([decode_prediction(p, **kw) for p in preds[i:i + per_window]])
                                           for i in windows], n)
    many_ms, many = cpu_ms_per_1000(lambda: [decode_predictions(preds[i:i + per_window], **kw)[0] for i in windows], n)
    assert all(a.request_ids == b.request_ids and (a.outputs.scores == b.outputs.scores).all()
               for a, b in zip(one, many, strict=True)), "the two decodes must give the same rows"
    score_ms, _ = cpu_ms_per_1000(lambda: [monitor.score(w, index=0, first_time=0, last_time=0) for w in many], n)
    print(f"{n} events of {r} row(s), windows of {args.window} rows; CPU ms per 1000 events:")
    print(f"  CloudEvent.from_kafka            {parse_ms:7.1f}")
    print(f"  PredictionMade.FromString        {proto_ms:7.1f}")
    print(f"  decode one by one + concat       {one_ms:7.1f}  (baseline)")
    print(f"  decode_predictions per window    {many_ms:7.1f}  (ratio {many_ms / one_ms:.2f})")
    print(f"  window scoring (monitor.score)   {score_ms:7.1f}")


if __name__ == "__main__":
    main()
