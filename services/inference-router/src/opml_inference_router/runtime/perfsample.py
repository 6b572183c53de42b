"""Measuring serving configurations of a model on a pool kind, for performance models.

Uses the worker's own code for the parts a kind decides (its execution provider, its int8
emulation by :func:`~.session.convert`, the padding of a batch to the kind's fixed shapes in
:meth:`Replica.run`), so a measurement on a kind is what a worker of that kind would do; only the
options being studied (threads, optimization level, execution mode, precision, batch) vary.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from opml_common.errors import FailedPrecondition
from opml_common.perfmodel import Sample, ServingConfig
from opml_inference_router.placement.fleet_config import ModelVersion, PoolKind
from opml_inference_router.runtime.external_data import check_external_data
from opml_inference_router.runtime.profiler import synthetic_inputs
from opml_inference_router.runtime.replica import Replica
from opml_inference_router.runtime.session import build_session, convert
from opml_inference_router_contract.model_config import ModelConfig


def mlp_mflop_per_row(path: Path) -> float:
    """The work of one row of an ONNX model: 2 x the weights of its MatMuls (MLPs, dense layers), in MFLOP."""
    import onnx

    graph = onnx.load(path, load_external_data=False).graph
    sizes = {init.name: int(np.prod(init.dims)) for init in graph.initializer}
    return sum(2.0 * sizes.get(name, 0) for node in graph.node if node.op_type in ("MatMul", "Gemm")
               for name in node.input) / 1e6


def measure(path: Path, config: ModelConfig, kind: PoolKind, configs: Sequence[ServingConfig], *,
            runs: int = 15, warmup: int = 3, passes: int = 3, seed: int = 0) -> list[Sample]:
    """Each configuration's time of one batch, in order (blocking): the median of ``runs`` batches
    (after ``warmup``), the lowest such median of ``passes`` passes over all configurations. On a
    shared machine another process can hold a core for a while; a median only absorbs short stalls,
    a later pass the longer ones. One session per (precision, threads, level, mode) and pass.

    Raises:
        FailedPrecondition: a configuration's precision is not one the kind runs.
        InvalidArgument: the model names external data outside its folder (as
            :func:`~.external_data.check_external_data`), or cannot be converted or loaded (as :func:`convert`).
    """
    check_external_data(path, name=path.name)
    for serving in configs:
        if serving.precision not in kind.precisions:
            raise FailedPrecondition(f"pool kind {kind.name} runs {', '.join(kind.precisions)}, "
                                     f"not {serving.precision}")
    mflop = mlp_mflop_per_row(path)
    rng = np.random.default_rng(seed)
    converted: dict[str, bytes] = {}
    best: dict[int, float] = {}

    def session_key(item: tuple[int, ServingConfig]) -> tuple:
        s = item[1]
        return (s.precision, s.threads, s.opt_level, s.execution_mode)

    ordered = sorted(enumerate(configs), key=session_key)
    for key, group in itertools.chain.from_iterable(
            itertools.groupby(ordered, key=session_key) for _ in range(passes)):
        precision, threads, level, mode = key
        if precision not in converted:
            converted[precision] = convert(path, precision, config, calibration=path.parent / "calibration.npz")
        session = build_session(converted[precision], kind, threads=threads, source=str(path), folder=path.parent,
                                opt_level=level, execution_mode=mode)
        replica = Replica(ModelVersion(config.name, 1), config, kind, precision, session)
        for index, serving in group:
            inputs = synthetic_inputs(config, serving.batch, rng)
            for _ in range(warmup):
                replica.run(inputs)
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                replica.run(inputs)
                times.append((time.perf_counter() - start) * 1000.0)
            best[index] = min(best.get(index, float("inf")), statistics.median(times))
    return [Sample(config.name, mflop, serving, best[index]) for index, serving in enumerate(configs)]
