"""One replica of a model version on this worker: an onnxruntime session that runs batches.

``run_batch`` is what the dynamic batcher calls in the replica's own thread: it joins requests
along dim 0, pads the batch up to the kind's next fixed shape (an accelerator runs only the shapes
it was built for), runs, drops the padding and hands each request its rows back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from opml_inference_router.placement.fleet_config import ModelVersion, PoolKind
from opml_inference_router.runtime.session import SessionSettings
from opml_inference_router_contract.model_config import ModelConfig

Tensors = Mapping[str, np.ndarray]


def batch_cap(config: ModelConfig, kind: PoolKind) -> int:
    """Largest batch a replica runs: the model's ``max_batch_size``, no more than the kind's largest
    fixed shape; 1 for a model without a batch dimension."""
    if config.max_batch_size < 1:
        return 1
    if not kind.batch_sizes:
        return config.max_batch_size
    fitting = [shape for shape in kind.batch_sizes if shape <= config.max_batch_size]
    return fitting[-1] if fitting else config.max_batch_size


@dataclass(eq=False)
class Replica:
    """A loaded model version (one instance: its own session). ``memory_mib`` is what loading it added
    to the worker's resident memory (session, weights, the arena after a batch of ``max_batch``).
    Instances compare by identity: two sessions of one version are two instances."""

    model: ModelVersion
    config: ModelConfig
    kind: PoolKind
    precision: str
    session: ort.InferenceSession
    memory_mib: float = 0.0

    def __post_init__(self) -> None:
        self.max_batch = batch_cap(self.config, self.kind)
        self.batches = self.config.max_batch_size > 0
        self._outputs = [spec.name for spec in self.config.outputs]

    @property
    def settings(self) -> SessionSettings:
        """The session's options, as onnxruntime reports them."""
        return SessionSettings.of(self.session)

    def padded(self, rows: int) -> int:
        """The batch shape ``rows`` rows run as on this kind."""
        if not self.batches or not self.kind.batch_sizes:
            return rows
        return next((shape for shape in self.kind.batch_sizes if shape >= rows), rows)

    def run(self, inputs: Tensors) -> dict[str, np.ndarray]:
        """One batch (already joined), padded to the kind's shape; the padding is dropped from outputs."""
        rows = len(next(iter(inputs.values()))) if self.batches else 1
        shape = self.padded(rows)
        if shape > rows:
            inputs = {name: np.concatenate([array, np.repeat(array[-1:], shape - rows, axis=0)])
                      for name, array in inputs.items()}
        results = self.session.run(self._outputs, dict(inputs))
        return {name: (value[:rows] if shape > rows else value) for name, value in zip(self._outputs, results)}

    def run_batch(self, requests: Sequence[Tensors]) -> list[dict[str, np.ndarray]]:
        """Runs several requests as one batch and splits the outputs back by each request's rows."""
        if len(requests) == 1:
            return [self.run(requests[0])]
        names = list(requests[0])
        joined = {name: np.concatenate([request[name] for request in requests]) for name in names}
        outputs = self.run(joined)
        replies: list[dict[str, np.ndarray]] = []
        start = 0
        for request in requests:
            end = start + len(request[names[0]])
            replies.append({name: value[start:end] for name, value in outputs.items()})
            start = end
        return replies
