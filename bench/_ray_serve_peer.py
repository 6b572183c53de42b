"""Ray Serve 2.60 serving an ONNX file with onnxruntime: the Ray peer of bench/inference_router_peers.py
(run in .venv-peers-ray, never by the project's Python).

A local Ray cluster of ``--replicas`` CPUs, one deployment of ``--replicas`` replicas batching with
``@serve.batch``; a request is an HTTP POST whose body is the float32 rows (raw bytes, the lightest
encoding Ray Serve takes), the response the float32 scores. Prints ``{"http_port": ...}`` once
serving, shuts Serve and Ray down on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading

import numpy as np
import onnxruntime as ort
import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import Response


def deployment(args: argparse.Namespace):
    @serve.deployment(num_replicas=args.replicas, max_ongoing_requests=4 * args.max_batch,
                      ray_actor_options={"num_cpus": 1})
    class OnnxModel:
        def __init__(self, path: str, threads: int) -> None:
            options = ort.SessionOptions()
            options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            self._session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            self._input = self._session.get_inputs()[0]
            self._features = self._input.shape[1]

        @serve.batch(max_batch_size=args.max_batch, batch_wait_timeout_s=args.wait_s)
        async def infer(self, rows: list[np.ndarray]) -> list[np.ndarray]:
            scores = self._session.run(None, {self._input.name: np.concatenate(rows)})[0]
            sizes = np.cumsum([len(row) for row in rows])[:-1]
            return np.split(scores, sizes)

        async def __call__(self, request: Request) -> Response:
            rows = np.frombuffer(await request.body(), dtype=np.float32).reshape(-1, self._features)
            return Response((await self.infer(rows)).tobytes(), media_type="application/octet-stream")

    return OnnxModel.bind(args.model, args.threads)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--wait-s", type=float, default=0.002)
    parser.add_argument("--temp-dir", required=True)
    args = parser.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ray.init(num_cpus=args.replicas, include_dashboard=False, object_store_memory=100 * 2**20,
             _temp_dir=args.temp_dir, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(deployment(args), name="onnx", route_prefix="/")
        print(json.dumps({"http_port": args.port}), flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
