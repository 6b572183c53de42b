"""NannyML CBPE on a stream the monitoring-scorer bench wrote: runs in .venv-peers-nannyml (nannyml 0.13.1).

Reads an .npz (reference and analysis class scores, predictions, reference labels, chunk size) and
writes a .json with the estimated accuracy per chunk and the time fit and estimate took.
Usage: python bench/monitoring_scorer_nannyml_peer.py IN.npz OUT.json [IN2.npz OUT2.json ...]
       python bench/monitoring_scorer_nannyml_peer.py --export-datasets OUT.npz   (NannyML's own data sets)
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("NML_DISABLE_USAGE_LOGGING", "1")

import nannyml as nml  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402


def frame(scores: np.ndarray, predicted: np.ndarray, labels: np.ndarray | None) -> tuple[pd.DataFrame, object]:
    data = {"y_pred": predicted.astype(int)}
    if scores.shape[1] == 2:
        data["p1"] = scores[:, 1]
        proba: object = "p1"
    else:
        for k in range(scores.shape[1]):
            data[f"p{k}"] = scores[:, k]
        proba = {k: f"p{k}" for k in range(scores.shape[1])}
    if labels is not None:
        data["y_true"] = labels.astype(int)
    return pd.DataFrame(data), proba


def export(target: str) -> None:
    """NannyML's synthetic car-loan and binary data sets (they ship in its wheel) as plain arrays."""
    out = {}
    for name, loader, truth in (("car_loan", nml.load_synthetic_car_loan_dataset, "repaid"),
                                ("binary", nml.load_synthetic_binary_classification_dataset, "work_home_actual")):
        reference, analysis, targets = loader()
        analysis = analysis.merge(targets, on="id")
        reference, analysis = reference.rename(columns={truth: "y_true"}), analysis.rename(columns={truth: "y_true"})
        skip = {"id", "timestamp", "period", "y_pred_proba", "y_pred", "y_true"}
        features = [c for c in reference.columns if c not in skip]
        out[f"{name}.features"] = np.array(features)
        for part, df in (("ref", reference), ("ana", analysis)):
            for column in features:
                values = df[column].to_numpy()
                out[f"{name}.{part}.feature.{column}"] = (values.astype(str) if values.dtype == object
                                                          else values.astype(float))
            out[f"{name}.{part}.p1"] = df["y_pred_proba"].to_numpy(dtype=float)
            out[f"{name}.{part}.pred"] = df["y_pred"].to_numpy(dtype=float)
            out[f"{name}.{part}.labels"] = df["y_true"].to_numpy(dtype=float)
    np.savez(target, **out)


def main() -> None:
    if sys.argv[1] == "--export-datasets":
        export(sys.argv[2])
        return
    for source, target in zip(sys.argv[1::2], sys.argv[2::2]):
        run(source, target)


def run(source: str, target: str) -> None:
    arrays = np.load(source)
    chunk = int(arrays["chunk"])
    reference, proba = frame(arrays["ref_scores"], arrays["ref_pred"], arrays["ref_labels"])
    analysis, _ = frame(arrays["scores"], arrays["pred"], None)
    problem = "classification_binary" if arrays["ref_scores"].shape[1] == 2 else "classification_multiclass"
    started = time.perf_counter()
    estimator = nml.CBPE(y_pred_proba=proba, y_pred="y_pred", y_true="y_true", problem_type=problem,
                         metrics=["accuracy"], chunk_size=chunk)
    estimator.fit(reference)
    fitted = time.perf_counter()
    result = estimator.estimate(analysis)
    done = time.perf_counter()
    table = result.filter(period="analysis").to_df()
    values = [float(v) for v in table[("accuracy", "value")]]
    with open(target, "w") as out:
        json.dump({"accuracy": values, "fit_s": fitted - started, "estimate_s": done - fitted,
                   "rows": int(len(analysis))}, out)


if __name__ == "__main__":
    main()
