"""Estimated accuracy per window: the monitoring-scorer's MPP and CBPE against NannyML's CBPE, and
the scorer's throughput against CBPE's batch throughput, on the same streams in the same run.

Streams (each: a reference set, then windows of live rows whose true accuracy is known):
  synthetic binary and multiclass (opml_monitoring_scorer.synthetic) under covariate shift, prior
  shift and concept shift (the last also "after labels": the MPP recalibrated from the labels of the
  first two shifted windows, measured on the rest); scikit-learn's digits with a covariate shift
  (rows resampled toward heavy ink) and a prior shift (classes 0-4 kept at 20 %); NannyML's own
  synthetic car-loan and binary data sets (they ship in its wheel; exported by the peer script).
NannyML 0.13.1 runs in its own venv (.venv-peers-nannyml, created here; statsmodels added by hand,
NML_DISABLE_USAGE_LOGGING=1) through bench/monitoring_scorer_nannyml_peer.py.

    .venv/bin/python bench/monitoring_scorer_cbpe.py                   # 3 seeds, 10 windows of 1000
    .venv/bin/python bench/monitoring_scorer_cbpe.py --seeds 0 --windows 6 --window 500   # reduced

Prints per stream the mean absolute error of each estimate over windows (mean and spread over seeds)
and the ratio ours / NannyML's; then predictions scored per second in one process (decode of the
PredictionMade bytes through the shared codec, drift, data quality, MPP, CBPE, score) against
NannyML CBPE's estimate rows per second.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression
from tritonclient.grpc import service_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "services" / "monitoring-scorer" / "src"))

from opml.inference.v1 import events_pb2 as inference_events  # noqa: E402

from opml_common.kserve_codec import encode_outputs, encode_request  # noqa: E402
from opml_monitoring_scorer.core.cbpe import ConfidenceEstimator  # noqa: E402
from opml_monitoring_scorer.core.config import MonitoringConfig  # noqa: E402
from opml_monitoring_scorer.core.decode import Batch, decode_prediction  # noqa: E402
from opml_monitoring_scorer.core.monitor import ModelMonitor  # noqa: E402
from opml_monitoring_scorer.core.mpp import MPP  # noqa: E402
from opml_monitoring_scorer.core.reference import Outputs, ReferenceSet, Task, performance  # noqa: E402
from opml_monitoring_scorer.synthetic import SyntheticWorld  # noqa: E402

PEER_VENV = ROOT / ".venv-peers-nannyml"
PEER_REQUIREMENTS = ["nannyml==0.13.1", "statsmodels==0.15.0"]
PEER = ROOT / "bench" / "monitoring_scorer_nannyml_peer.py"


def peer_python() -> Path:
    python = PEER_VENV / "bin" / "python"
    if not python.exists():
        print(f"creating {PEER_VENV} with {' '.join(PEER_REQUIREMENTS)} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PEER_REQUIREMENTS], check=True)
    return python


class Stream:
    """A reference and windows (features, outputs, labels) of one scenario."""

    def __init__(self, name: str, task: Task, reference: ReferenceSet, windows: list[tuple[dict, Outputs, np.ndarray]],
                 labelled_windows: int = 0) -> None:
        self.name, self.task, self.reference, self.windows = name, task, reference, windows
        self.labelled_windows = labelled_windows  # concept shift "after labels": these windows teach the MPP


def synthetic(task: Task, kind: str, seed: int, windows: int, size: int) -> Stream:
    world = SyntheticWorld(task, seed=seed)
    reference = world.reference(3000)
    out = []
    if kind == "concept":
        world.flipped = True
    for w in range(windows):
        step = w / max(windows - 1, 1)
        if kind == "covariate":
            rows = world.rows(size, shift=np.array([2.0 * step, -1.0 * step, 0, 0]))
        elif kind == "prior":
            rows = world.rows(int(size / (1 - 0.5 * step * 0.9)) + 1, prior=1 - 0.9 * step)
        else:
            rows = world.rows(size)
        out.append((rows.features, rows.outputs, rows.labels))
    return Stream(f"synthetic {task.value} {kind} shift", task, reference, out,
                  labelled_windows=2 if kind == "concept" else 0)


def digits(kind: str, seed: int, windows: int, size: int) -> Stream:
    rng = np.random.default_rng(seed)
    x, y = load_digits(return_X_y=True)
    x = x / 16.0  # pixel values 0..16
    order = rng.permutation(len(y))
    x, y = x[order], y[order].astype(float)
    train, ref, pool = slice(0, 700), slice(700, 1250), slice(1250, None)
    model = LogisticRegression(max_iter=2000, C=0.5).fit(x[train], y[train])

    def rows(index: np.ndarray) -> tuple[dict, Outputs, np.ndarray]:
        scores = model.predict_proba(x[index])
        features = {f"ink_row{r}": x[index, r * 8:(r + 1) * 8].sum(axis=1) for r in range(8)}
        features.update({f"px{i}": x[index, i] for i in (19, 27, 35, 43)})
        return features, Outputs(np.argmax(scores, axis=1).astype(float), scores), y[index]

    features, outputs, labels = rows(np.arange(len(y))[ref])
    reference = ReferenceSet.build(task=Task.MULTICLASS, features=features, predicted=outputs.predicted,
                                   scores=outputs.scores, labels=labels, min_rows=100)
    candidates = np.arange(len(y))[pool]
    ink = x[candidates].sum(axis=1)
    ink = (ink - ink.mean()) / ink.std()
    out = []
    for w in range(windows):
        step = w / max(windows - 1, 1)
        weights = np.exp(2.5 * step * ink) if kind == "covariate" else np.where(y[candidates] < 5, 1 - 0.8 * step, 1.0)
        chosen = rng.choice(candidates, size=size, p=weights / weights.sum())
        out.append(rows(chosen))
    return Stream(f"digits {kind} shift", Task.MULTICLASS, reference, out)


def nannyml_streams(data: dict, windows: int, size: int) -> list[Stream]:
    out = []
    for name in ("car_loan", "binary"):
        features = [str(f) for f in data[f"{name}.features"]]

        def part(p: str, name: str = name, features: list[str] = features) -> tuple[dict, Outputs, np.ndarray]:
            cols = {f: data[f"{name}.{p}.feature.{f}"] for f in features}
            return cols, Outputs(data[f"{name}.{p}.pred"], data[f"{name}.{p}.p1"][:, None]), data[f"{name}.{p}.labels"]

        rf, ro, rl = part("ref")
        keep = slice(0, 10_000)  # the first 10,000 of its 50,000 reference rows, for both estimators
        reference = ReferenceSet.build(task=Task.BINARY, features={k: v[keep] for k, v in rf.items()},
                                       predicted=ro.predicted[keep], scores=ro.scores[keep], labels=rl[keep])
        af, ao, al = part("ana")
        n = min(len(al), windows * size)
        chunks = []
        for start in range(0, n - size + 1, size):
            window = slice(start, start + size)
            chunks.append(({k: v[window] for k, v in af.items()},
                           Outputs(ao.predicted[window], ao.scores[window]), al[window]))
        out.append(Stream(f"NannyML synthetic {name.replace('_', '-')}", Task.BINARY, reference, chunks))
    return out


def ours(stream: Stream, seed: int) -> dict[str, list[float]]:
    mpp = MPP(stream.reference, seed=seed)
    cbpe = ConfidenceEstimator(stream.reference)
    result: dict[str, list[float]] = {"truth": [], "mpp": [], "cbpe": [], "mpp_after_labels": []}
    for features, outputs, labels in stream.windows:
        result["truth"].append(performance(stream.task, outputs.predicted, labels))
        result["mpp"].append(mpp.estimate(features, outputs))
        result["cbpe"].append(cbpe.estimate(outputs))
    if stream.labelled_windows:
        for features, outputs, labels in stream.windows[:stream.labelled_windows]:
            mpp.add_labels(features, outputs, labels)
        mpp.recalibrate()
        result["mpp_after_labels"] = [mpp.estimate(f, o) for f, o, _ in stream.windows[stream.labelled_windows:]]
    return result


def write_peer_input(stream: Stream, path: Path) -> None:
    ref = stream.reference.outputs
    np.savez(path, ref_scores=ref.class_scores(), ref_pred=ref.predicted, ref_labels=stream.reference.labels,
             scores=np.concatenate([o.class_scores() for _, o, _ in stream.windows]),
             pred=np.concatenate([o.predicted for _, o, _ in stream.windows]),
             chunk=np.array(len(stream.windows[0][2])))


def mae(estimates: list[float], truth: list[float]) -> float:
    return float(np.mean(np.abs(np.asarray(estimates) - np.asarray(truth))))


def throughput(seed: int, rows: int = 20_000, window: int = 1000) -> float:
    """Predictions per second through decode (PredictionMade bytes, shared codec) and window scoring."""
    world = SyntheticWorld(Task.MULTICLASS, seed=seed)
    monitor = ModelMonitor(world.reference(3000), MonitoringConfig())
    data = world.rows(rows)
    x = np.column_stack([data.features[f"x{i}"] for i in range(4)]).astype(np.float32)
    events = []
    for i in range(rows):
        request = encode_request("m", {"x": x[i:i + 1],
                                       "color": np.array([[data.features["color"][i].encode()]], dtype=object)})
        response = encode_outputs(pb.ModelInferResponse(), {"p": data.outputs.scores[i:i + 1].astype(np.float32)})
        events.append(inference_events.PredictionMade(request_id=str(i), model_name="m", model_version="1",
                                                      infer_request=request.SerializeToString(),
                                                      infer_response=response.SerializeToString()).SerializeToString())
    names = {"x": ["x0", "x1", "x2", "x3"]}
    started = time.perf_counter()
    for start in range(0, rows, window):
        batches = [decode_prediction(inference_events.PredictionMade.FromString(raw), task=Task.MULTICLASS,
                                     feature_names=names) for raw in events[start:start + window]]
        monitor.score(Batch.concat(batches), index=start // window, first_time=0, last_time=0)
    return rows / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--window", type=int, default=1000)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    python = peer_python()
    errors: dict[str, dict[str, list[float]]] = {}
    peer_rows_per_s: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        exported = Path(tmp) / "nml.npz"
        subprocess.run([str(python), str(PEER), "--export-datasets", str(exported)], check=True)
        nml_data = dict(np.load(exported))
        for seed in seeds:
            streams = [synthetic(Task.BINARY, k, seed, args.windows, args.window)
                       for k in ("covariate", "prior", "concept")]
            streams.append(synthetic(Task.MULTICLASS, "covariate", seed, args.windows, args.window))
            streams += [digits(k, seed, args.windows, min(args.window, 400)) for k in ("covariate", "prior")]
            if seed == seeds[0]:
                streams += nannyml_streams(nml_data, args.windows, args.window)  # fixed data: one run
            jobs = []
            for n, stream in enumerate(streams):
                source, target = Path(tmp) / f"{seed}-{n}.npz", Path(tmp) / f"{seed}-{n}.json"
                write_peer_input(stream, source)
                jobs += [str(source), str(target)]
            subprocess.run([str(python), str(PEER), *jobs], check=True,
                           env={"NML_DISABLE_USAGE_LOGGING": "1", "PATH": "/usr/bin:/bin"})
            for n, stream in enumerate(streams):
                peer = json.loads((Path(tmp) / f"{seed}-{n}.json").read_text())
                peer_rows_per_s.append(peer["rows"] / peer["estimate_s"])
                mine = ours(stream, seed)
                row = errors.setdefault(stream.name, {"mpp": [], "cbpe": [], "nannyml": [], "mpp_after_labels": [],
                                                      "nannyml_after": []})
                row["mpp"].append(mae(mine["mpp"], mine["truth"]))
                row["cbpe"].append(mae(mine["cbpe"], mine["truth"]))
                row["nannyml"].append(mae(peer["accuracy"][:len(mine["truth"])], mine["truth"]))
                if mine["mpp_after_labels"]:
                    k = stream.labelled_windows
                    row["mpp_after_labels"].append(mae(mine["mpp_after_labels"], mine["truth"][k:]))
                    row["nannyml_after"].append(mae(peer["accuracy"][k:len(mine["truth"])], mine["truth"][k:]))
            print(f"seed {seed} done", flush=True)
    print(f"\nMAE of estimated accuracy per window (mean ± std over seeds {seeds}; {args.windows} windows of "
          f"{args.window} rows, digits {min(args.window, 400)}):")
    print(f"{'stream':<36} {'MPP':>14} {'our CBPE':>14} {'NannyML CBPE':>14} {'MPP/NannyML':>12}")

    def cell(values: list[float]) -> str:
        return f"{np.mean(values):.4f}±{np.std(values):.4f}"

    for name, row in errors.items():
        print(f"{name:<36} {cell(row['mpp']):>14} {cell(row['cbpe']):>14} {cell(row['nannyml']):>14} "
              f"{np.mean(row['mpp']) / np.mean(row['nannyml']):>12.2f}")
        if row["mpp_after_labels"]:
            print(f"{'  ... after labels (windows 3..)':<36} {cell(row['mpp_after_labels']):>14} {'':>14} "
                  f"{cell(row['nannyml_after']):>14} "
                  f"{np.mean(row['mpp_after_labels']) / np.mean(row['nannyml_after']):>12.2f}")
    ours_rate = [throughput(seed) for seed in seeds[:1]]
    print(f"\nthroughput, one process: scorer {np.mean(ours_rate):,.0f} predictions/s (decode + score, windows of "
          f"1000) vs NannyML CBPE estimate {np.mean(peer_rows_per_s):,.0f} rows/s (batch, scores only); "
          f"ratio {np.mean(ours_rate) / np.mean(peer_rows_per_s):.2f}")


if __name__ == "__main__":
    main()
